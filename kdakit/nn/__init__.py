"""Neural-network layers built on kdakit's KDA ops."""

from kdakit.nn.cache import KDACache
from kdakit.nn.kda_layer import KimiDeltaAttention
from kdakit.nn.short_conv import ShortConvolution, short_conv

__all__ = ["KDACache", "KimiDeltaAttention", "ShortConvolution", "short_conv"]
