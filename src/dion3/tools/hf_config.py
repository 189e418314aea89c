"""A Hugging Face `config.json` as the commands' model shapes (`dion3 plan --hf-config`), read as
plain JSON (no transformers import): a decoder of the Llama family (Llama, Mistral, Qwen2/3, and
their mixtures of experts such as Mixtral and Qwen-MoE), whose matrices are

    q (heads·head_dim × d), o (d × heads·head_dim), k and v (kv_heads·head_dim × d)   per layer
    gate and up (ffn × d), down (d × ffn)                                               a dense MLP
    router (E × d), and stacks [E, ffn_e, d] / [E, d, ffn_e] of the experts' gate, up and down
    (+ a shared expert's gate, up, down where the config has one)                        a MoE MLP

and whose embedding, LM head (untied unless tie_word_embeddings) and norms go to AdamW. Configs
this layout does not describe (latent attention, MoE on some layers only) are refused by name:
describe them with --shapes instead.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..ortho.cost import MatrixShape
from .models import Preset, decoder_scalars, llama

# fields of configs whose layout is not the one above, and what they mean
UNSUPPORTED = {
    "kv_lora_rank": "multi-head latent attention (DeepSeek)",
    "q_lora_rank": "multi-head latent attention (DeepSeek)",
    "first_k_dense_replace": "dense layers before the MoE layers (DeepSeek)",
    "mlp_only_layers": "MoE on some layers only",
}
EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")
# model_type values whose Hugging Face modules hold q, k, v, o and gate, up, down (or their experts)
# as separate matrices, the layout above; another type is read the same way, with a note
KNOWN_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma", "gemma2",
               "gemma3_text", "olmo2", "granite")


@dataclass(frozen=True)
class ConfigModel:
    """What the commands need of a config: the shapes, the expert count of each stacked shape,
    and the parameters one token multiplies by (every matrix and the LM head, experts counted
    num_experts_per_tok times)."""

    preset: Preset
    experts: Optional[dict]  # shape name → experts in its stack; None for a dense model
    active_parameters: int
    note: str = ""  # what the reading assumed, for the user to check (an unlisted model_type)

    @property
    def hidden_parameters(self) -> int:
        """Every matrix the orthogonal optimizers step, each expert counted."""
        return sum(m.numel * (self.experts or {}).get(m.name, 1) for m in self.preset.matrices)


def read_config(path: str) -> dict:
    try:
        config = json.loads(Path(path).read_text())
    except OSError as error:
        raise ValueError(f"--hf-config: cannot read {path}: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"--hf-config: {path} is not JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--hf-config: {path} holds a JSON {type(config).__name__}, not a config object")
    return config.get("text_config", config)  # a multimodal config keeps its decoder's here


def _field(config: dict, name: str, path: str, default=None) -> int:
    value = config.get(name)
    if value is None:  # absent, or null as some configs write an unused field
        value = default
    if value is None:
        raise ValueError(f"--hf-config: {path} has no {name!r}; the plan needs hidden_size, intermediate_size, "
                         "num_hidden_layers, num_attention_heads and vocab_size (a Llama-family decoder)")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"--hf-config: {path}: {name} must be a positive integer, got {value!r}")
    return value


def config_model(path: str) -> ConfigModel:
    """The shapes of the decoder `path` describes (module docstring)."""
    config = read_config(path)
    kind = config.get("model_type")
    note = ("" if kind is None or kind in KNOWN_TYPES else
            f"model_type {kind!r} is not one this reading was written for ({', '.join(KNOWN_TYPES)}): its matrices are "
            "read as separate q, k, v, o and gate, up, down; where the model fuses them (qkv_proj, gate_up_proj), "
            "its fractions by cost and step differ")
    for name, meaning in UNSUPPORTED.items():
        if config.get(name):
            raise ValueError(f"--hf-config: {path} sets {name} ({meaning}), which the plan's Llama-family layout "
                             "does not describe; give the matrices with --shapes (and --experts) instead")
    if config.get("decoder_sparse_step", 1) not in (1, None):
        raise ValueError(f"--hf-config: {path} sets decoder_sparse_step {config['decoder_sparse_step']} (MoE on some "
                         "layers only); give the matrices with --shapes instead")
    d, layers = _field(config, "hidden_size", path), _field(config, "num_hidden_layers", path)
    heads = _field(config, "num_attention_heads", path)
    kv_heads = _field(config, "num_key_value_heads", path, heads)
    head_dim = _field(config, "head_dim", path, d // heads)
    vocab, tied = _field(config, "vocab_size", path), bool(config.get("tie_word_embeddings", False))
    name = Path(path).parent.name or Path(path).stem
    expert_field = next((f for f in EXPERT_COUNT_FIELDS if config.get(f)), None)
    if expert_field is None:
        ffn = _field(config, "intermediate_size", path)
        if heads * head_dim == d:  # the registry's Llama layout: one q,o shape
            preset = llama(name, layers, d, kv_heads * head_dim, ffn, vocab, tied)
        else:
            preset = _with_attention(name, layers, d, heads * head_dim, kv_heads * head_dim, (
                MatrixShape("gate,up", ffn, d, 2 * layers), MatrixShape("down", d, ffn, layers)), vocab, tied,
                f"ffn={ffn}")
        head = vocab * d
        return ConfigModel(preset, None, preset.matrix_numel + head, note)
    experts = _field(config, expert_field, path)
    chosen = _field(config, "num_experts_per_tok", path)
    if chosen > experts:
        raise ValueError(f"--hf-config: {path}: num_experts_per_tok {chosen} exceeds the {experts} experts")
    expert_ffn = _field(config, "moe_intermediate_size", path, config.get("intermediate_size"))
    mlp = [MatrixShape("router", experts, d, layers), MatrixShape("experts.gate,up", expert_ffn, d, 2 * layers),
           MatrixShape("experts.down", d, expert_ffn, layers)]
    shared = config.get("shared_expert_intermediate_size") or 0
    if shared:
        shared = _field(config, "shared_expert_intermediate_size", path)
        mlp += [MatrixShape("shared.gate,up", shared, d, 2 * layers), MatrixShape("shared.down", d, shared, layers)]
    preset = _with_attention(name, layers, d, heads * head_dim, kv_heads * head_dim, tuple(mlp), vocab, tied,
                             f"{experts} experts of ffn={expert_ffn}, {chosen} a token"
                             + (f", a shared expert of ffn={shared}" if shared else ""))
    stacked = {"experts.gate,up": experts, "experts.down": experts}
    per_token = sum(m.numel * (chosen if m.name in stacked else 1) for m in preset.matrices)
    return ConfigModel(preset, stacked, per_token + vocab * d, note)


def _with_attention(name: str, layers: int, d: int, q_dim: int, kv_dim: int, mlp: tuple, vocab: int, tied: bool,
                    mlp_text: str) -> Preset:
    matrices = (MatrixShape("q", q_dim, d, layers), MatrixShape("o", d, q_dim, layers),
                MatrixShape("k,v", kv_dim, d, 2 * layers)) + mlp
    scalars = decoder_scalars(layers, d, vocab, tied)
    description = (f"{layers} layers, d={d}, q={q_dim}, kv={kv_dim}, {mlp_text}, vocab={vocab}"
                   + (", tied embeddings" if tied else ""))
    return Preset(name, matrices, scalars, description, layers)
