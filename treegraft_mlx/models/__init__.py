"""Model architectures: which class reads a config and builds a model for each `model_type`.

decoder.py: the Llama skeleton with per-family switches (llama, mistral, qwen2, qwen3, phi3,
mixtral, qwen3_moe); gemma.py: Gemma 2 and Gemma 3 text; gemma4.py: Gemma 4 text, and
gemma4_assistant.py the assistant drafter Google ships beside it; hybrid.py: Qwen 3.5 and
Qwen3-Next (Gated DeltaNet and gated attention, dense and MoE); rope.py and moe.py: their parts.
"""

from __future__ import annotations

from .decoder import FAMILY_DEFAULTS, Model, ModelArgs
from .gemma import FAMILIES as GEMMA_FAMILIES
from .gemma import GemmaArgs, GemmaModel
from .gemma4 import FAMILIES as GEMMA4_FAMILIES
from .gemma4 import Gemma4Args, Gemma4Model
from .gemma4 import text_config as gemma4_text_config
from .gemma4_assistant import FAMILIES as ASSISTANT_FAMILIES
from .gemma4_assistant import AssistantArgs, Gemma4Assistant
from .hybrid import FAMILIES as HYBRID_FAMILIES
from .hybrid import HybridArgs, HybridModel
from .rope import legacy_keys

ARCHITECTURES: dict[str, tuple[type, type]] = {
    **{t: (ModelArgs, Model) for t in FAMILY_DEFAULTS},
    **{t: (GemmaArgs, GemmaModel) for t in GEMMA_FAMILIES},
    **{t: (HybridArgs, HybridModel) for t in HYBRID_FAMILIES},
    **{t: (Gemma4Args, Gemma4Model) for t in GEMMA4_FAMILIES},
    **{t: (AssistantArgs, Gemma4Assistant) for t in ASSISTANT_FAMILIES},
}
SUPPORTED_MODEL_TYPES = tuple(sorted(ARCHITECTURES))


def model_args(config: dict) -> ModelArgs:
    """The config's settings, read by its architecture's class (ValueError if unsupported)."""
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: "
                         f"{list(SUPPORTED_MODEL_TYPES)}")
    return ARCHITECTURES[model_type][0].from_config(config)


def build_class(args: ModelArgs) -> type:
    """The model class an architecture's args build."""
    return ARCHITECTURES[args.model_type][1]


def build_model(args: ModelArgs) -> Model:
    """The model with lazily initialised weights (no memory until evaluated or loaded)."""
    return ARCHITECTURES[args.model_type][1](args)


def legacy_config(config: dict) -> dict:
    """config.json with the keys transformers 4.x (and mlx_lm) read, beside the 5.x ones:
    `rope_theta` / `rope_scaling` (Gemma 3: `rope_local_base_freq`), Qwen3-MoE's
    `num_experts`; a Gemma 4 checkpoint's text model (gemma4.text_config). What the converter
    writes, so every reader sees the same model."""
    if config.get("model_type") in GEMMA4_FAMILIES:
        config = gemma4_text_config(config)
    out = dict(config)
    if config.get("rope_parameters"):
        args = model_args(config)
        out.update(legacy_keys(args.rope))
        if args.rope.partial_rotary_factor != 1.0:
            out["partial_rotary_factor"] = args.rope.partial_rotary_factor
        if args.rope.kind == "longrope":
            out["original_max_position_embeddings"] = args.rope.params[
                "original_max_position_embeddings"]
        if isinstance(args, GemmaArgs) and args.model_type == "gemma3_text":
            out["rope_local_base_freq"] = args.rope_local.theta
    if config.get("model_type") == "qwen3_moe" and "num_experts" not in config:
        out["num_experts"] = config.get("num_local_experts")
    return out


__all__ = ["Model", "ModelArgs", "SUPPORTED_MODEL_TYPES", "build_class", "build_model",
           "legacy_config",
           "model_args"]
