"""lathe.gateway"""
