"""flashtx layers: thin nn.Modules over flashtx's fused ops."""
from .attention import MultiheadAttention
from .kv_cache import KVCache, PagedKVCache
from .block import BlockCache, TransformerBlock, llama_hidden_dim
from .norm import RMSNorm
from .rotary import RotaryEmbedding
from .swiglu import SwiGLU

__all__ = ["RotaryEmbedding", "SwiGLU", "RMSNorm", "MultiheadAttention", "KVCache", "PagedKVCache", "TransformerBlock",
           "BlockCache", "llama_hidden_dim"]
