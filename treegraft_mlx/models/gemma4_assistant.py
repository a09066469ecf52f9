"""The small "assistant" drafter Google ships beside each Gemma 4 size (`gemma4_assistant`),
as transformers 5.24-5.25 defines it and its SinglePositionMultiTokenCandidateGenerator
drives it.

A row's input is the target's embedding of a token (times sqrt(D)) concatenated with a
hidden vector of the target's width: for the root, the target's final-norm hidden state of
the token before it; for a drafted token, the `post_projection` of its parent row's output
(the carry). `pre_projection` maps it to the assistant's width; its Gemma 4 layers hold no
keys and values of their own: every one attends to the target's store-layer K/V of its
type (the last sliding and the last full layer with K/V of their own), committed positions
only, with every row at the root's position. Then the final norm and the tied head, without
soft-cap; small sizes score only the tokens of the top `centroid_intermediate_top_k` of
`num_centroids` centroids (`use_ordered_embeddings`), the others one below the row's
lowest scored logit. Rows never see each other, so one forward runs any set of rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from .gemma4 import FULL, SLIDING, Gemma4Args, Gemma4Block

FAMILIES: dict[str, dict[str, Any]] = {"gemma4_assistant": {"tie_word_embeddings": True}}
OUTER_KEYS = ("backbone_hidden_size", "use_ordered_embeddings", "num_centroids",
              "centroid_intermediate_top_k", "tie_word_embeddings", "eos_token_id")


@dataclass
class AssistantArgs(Gemma4Args):
    backbone_hidden_size: int = 1536
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_intermediate_top_k: int = 32

    FAMILIES: ClassVar[dict[str, dict[str, Any]]] = FAMILIES

    @classmethod
    def from_config(cls, config: dict) -> "AssistantArgs":
        """The text settings come from `text_config`; every layer reads the target's K/V."""
        if "text_config" not in config:
            raise ValueError("a gemma4_assistant config needs its text_config")
        text = {**config["text_config"], **{k: config[k] for k in OUTER_KEYS if k in config},
                "model_type": config["model_type"]}
        text["num_kv_shared_layers"] = text.get("num_hidden_layers")
        return super().from_config(text)

    def derive(self, config: dict) -> None:
        super().derive(config)
        if self.hidden_size_per_layer_input or self.enable_moe_block:
            raise ValueError("a Gemma 4 assistant has no per-layer inputs and no experts")
        if self.use_ordered_embeddings and self.vocab_size % self.num_centroids:
            raise ValueError(f"vocab_size {self.vocab_size} is not a multiple of "
                             f"num_centroids {self.num_centroids}")

    def reads(self) -> dict[str, tuple[int, int]]:
        """Per layer type it has, the (KV heads, head dim) of the target K/V it attends to."""
        return {s.layer_type: (s.kv_heads, s.head_dim) for s in self.specs}


class MaskedEmbedder(nn.Module):
    """Scores only the tokens of each row's top centroids; `token_ordering` lists the
    vocabulary centroid by centroid."""

    def __init__(self, args: AssistantArgs):
        super().__init__()
        self.centroids = nn.Linear(args.hidden_size, args.num_centroids, bias=False)
        self.token_ordering = mx.zeros((args.vocab_size,), dtype=mx.int32)
        self.top_k, self.groups = args.centroid_intermediate_top_k, args.num_centroids

    def __call__(self, h: mx.array, embedding: nn.Module, vocab: int) -> mx.array:
        """(R, V) logits of rows h (R, D) against the tied embedding's rows."""
        top = mx.argpartition(-self.centroids(h), self.top_k - 1, axis=-1)[:, :self.top_k]
        clusters = self.token_ordering.astype(mx.int32).reshape(self.groups, -1)
        chosen = clusters[top].reshape(h.shape[0], -1)                # (R, K) token ids
        scored = (embedding(chosen) @ h[:, :, None])[..., 0]          # (R, K)
        floor = scored.min(axis=-1, keepdims=True) - 1.0
        out = mx.broadcast_to(floor, (h.shape[0], vocab))
        return mx.put_along_axis(out, chosen, scored, axis=-1)


class Body(nn.Module):
    def __init__(self, args: AssistantArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [Gemma4Block(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Gemma4Assistant(nn.Module):
    """`assistant(rows, position, kv)` -> (logits (R, V), carry (R, backbone width))."""

    RECURRENT: ClassVar[bool] = False
    FULL_PRECISION: ClassVar[tuple[str, ...]] = ()
    ASSISTANT: ClassVar[bool] = True     # drafts from a Gemma 4 target's states (drafters/)

    def __init__(self, args: AssistantArgs):
        super().__init__()
        self.args, self.model_type = args, args.model_type
        self.model = Body(args)
        b, d = args.backbone_hidden_size, args.hidden_size
        self.pre_projection = nn.Linear(2 * b, d, bias=False)
        self.post_projection = nn.Linear(d, b, bias=False)
        if args.use_ordered_embeddings:
            self.masked_embedding = MaskedEmbedder(args)

    def __call__(self, rows: mx.array, position: int, kv: dict) -> tuple[mx.array, mx.array]:
        """rows (R, 2 x backbone width): [target embedding, hidden]; every row at
        `position`; kv: per layer type the target's (keys, values) it reads (1, heads, n,
        dim)."""
        R = rows.shape[0]
        h = self.pre_projection(rows)[None]
        positions = mx.full((R,), position, dtype=mx.int32)
        shared = {SLIDING: kv.get(SLIDING), FULL: kv.get(FULL)}
        for i, layer in enumerate(self.model.layers):
            h = layer(h, positions, None, None, i, 0, shared)
        h = self.model.norm(h[0])
        return self.logits(h), self.post_projection(h)

    def logits(self, h: mx.array) -> mx.array:
        if "masked_embedding" in self:
            return self.masked_embedding(h, self.model.embed_tokens, self.args.vocab_size)
        if "lm_head" in self:
            return self.lm_head(h)
        return self.model.embed_tokens.as_linear(h)

    def checkpoint_names(self, weights: dict, halves=None, unfuse: bool = True) -> dict:
        """The checkpoint's names are this model's."""
        return weights

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        out = dict(weights)
        if "masked_embedding.token_ordering" in out:
            out["masked_embedding.token_ordering"] = out[
                "masked_embedding.token_ordering"].astype(mx.int32)
        if not self.args.tie_word_embeddings and "lm_head.weight" in out:
            self.lm_head = nn.Linear(self.args.hidden_size, self.args.vocab_size, bias=False)
        return out

    @property
    def layers(self):
        return self.model.layers
