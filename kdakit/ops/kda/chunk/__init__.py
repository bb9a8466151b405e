"""Chunked KDA: the public op (``api``) and the 64-token Triton pipeline's stages.

Nothing is imported here: each stage module is imported by its full name, so that a kernel module can be
loaded (and built for sm_90a) without pulling in the op and its dispatch.
"""
