"""flashtx layers: thin nn.Modules over flashtx's fused ops."""
from .attention import KVCache, MultiheadAttention
from .block import BlockCache, TransformerBlock, llama_hidden_dim
from .norm import RMSNorm
from .rotary import RotaryEmbedding
from .swiglu import SwiGLU

__all__ = ["RotaryEmbedding", "SwiGLU", "RMSNorm", "MultiheadAttention", "KVCache", "TransformerBlock", "BlockCache",
           "llama_hidden_dim"]
