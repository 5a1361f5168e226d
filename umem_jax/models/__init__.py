"""Models: Flax NNX hybrid decoders whose layers read and write the arena through the kernels.

    from umem_jax.models import load_model
    model = load_model("gemma3-270m")        # or a HF dir, a .gguf, "tiny", "tiny-attention"
    decls = model.decls()                    # one LayerDecl per layer -> umem_jax.memory.plan
    step = model.jit_forward()               # forward(params, arena, batch), arena donated
    logits, arena = step(model.params, arena, batch)
"""

from ..core.batch import Batch, make_batch
from .config import ModelConfig
from .loader import (
    DEFAULT_MODEL,
    cache_dir,
    convert_gguf,
    fetch_default_model,
    load_model,
    load_tokenizer,
    save_pretrained,
)
from .model import Model
from .registry import from_hf_config, load_hf_config, model_class, supported_architectures
from .tiny import tiny_config, tiny_model

__all__ = ["DEFAULT_MODEL", "Batch", "Model", "ModelConfig", "cache_dir", "convert_gguf", "fetch_default_model",
           "from_hf_config", "load_hf_config", "load_model", "load_tokenizer", "make_batch", "model_class",
           "save_pretrained", "supported_architectures", "tiny_config", "tiny_model"]
