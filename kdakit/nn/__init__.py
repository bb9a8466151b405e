"""Neural-network layers built on kdakit's KDA ops."""

from kdakit.nn.kda_layer import KimiDeltaAttention

__all__ = ["KimiDeltaAttention"]
