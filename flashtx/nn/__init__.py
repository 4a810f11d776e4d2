"""flashtx layers: thin nn.Modules over flashtx's fused ops."""
from .rotary import RotaryEmbedding
from .swiglu import SwiGLU

__all__ = ["RotaryEmbedding", "SwiGLU"]
