"""lathe"""
