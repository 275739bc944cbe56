"""rpcompile.runtime"""
