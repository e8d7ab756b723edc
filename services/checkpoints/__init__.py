"""lathe.checkpoints"""
