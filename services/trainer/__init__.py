"""lathe.trainer"""
