"""lathe.sampler"""
