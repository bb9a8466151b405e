"""recurrent"""
