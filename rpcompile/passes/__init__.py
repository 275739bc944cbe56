"""rpcompile.passes"""
