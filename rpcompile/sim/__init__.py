"""rpcompile.sim"""
