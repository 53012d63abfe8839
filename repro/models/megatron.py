"""Read a Megatron-LM GPT or BERT checkpoint (its `torch` format) as this project's TP shards.

    repro checkpoint import-megatron /ckpts/gpt2_345m --out runs/megatron-345m --tp 2

Files and layouts: `repro.models.megatron_files` (any TP x PP; each pipeline stage numbers its layers
from 0, offset here by the stages before it). Both model generations' names are read: the legacy
`language_model.{embedding, transformer|encoder}` (2019 on; BERT adds `language_model.pooler`,
`lm_head` (its norm `layernorm`, later `norm`), `binary_head`) and megatron-core's `embedding`, `decoder` (GPT) or `encoder` (BERT, with
`pooler`, `lm_head`, `output_layer.bias`, `binary_head`), local and Transformer Engine layer specs. Each TP rank's fused query/key/value rows are ordered by the file's
`checkpoint_version`: 0 (2019) as [3, np, hn] (our order), 1.0 as [np, hn, 3], 2.0 and 3.0 as
[np, 3, hn] (np: that rank's heads, hn: the head size). The weights are the model's own (fp16/bf16
when trained so), as Megatron evaluates them; optimizer state is not read. The GeLU forms (tanh or
erf) follow the saved arguments and the model generation (`gelu_forms`); zero-centred layer norms
(--apply-layernorm-1p) get their 1 back; a BERT trained with --bert-no-binary-head gets a fresh pooler
and SOP head, with a warning. Architectures our models lack are refused by name.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from repro.models.config import ModelConfig
from repro.models.megatron_files import MegatronFormatError, load_rank_file, locate, model_state

GPT2_TOKENS = 50257
BERT_TOKENIZERS = {"BertWordPieceLowerCase": 30522, "BertWordPieceCase": 28996}
"""Megatron-LM's BERT tokenizer types -> their WordPiece vocabulary sizes (uncased, cased)."""
_LAYER = re.compile(r"^(?:language_model\.(?:transformer|encoder)|decoder|encoder)\.layers\.(\d+)\.(.+)$")
_STACKS = ("language_model.transformer", "language_model.encoder", "decoder", "encoder")  # megatron-core BERT: encoder


def _layer_names() -> dict[str, str]:
    pairs = [("input_layernorm", "ln_1"), ("post_attention_layernorm", "ln_2"), ("pre_mlp_layernorm", "ln_2"),
             ("attention.query_key_value", "attn.c_attn"), ("self_attention.query_key_value", "attn.c_attn"),
             ("self_attention.linear_qkv", "attn.c_attn"), ("attention.dense", "attn.c_proj"),
             ("self_attention.dense", "attn.c_proj"), ("self_attention.linear_proj", "attn.c_proj"),
             ("mlp.dense_h_to_4h", "mlp.c_fc"), ("mlp.linear_fc1", "mlp.c_fc"),
             ("mlp.dense_4h_to_h", "mlp.c_proj"), ("mlp.linear_fc2", "mlp.c_proj")]
    names = {f"{src}.{p}": f"{dst}.{p}" for src, dst in pairs for p in ("weight", "bias")}
    for fused, norm in (("self_attention.linear_qkv", "ln_1"), ("mlp.linear_fc1", "ln_2")):  # Transformer Engine
        names |= {f"{fused}.layer_norm_{p}": f"{norm}.{p}" for p in ("weight", "bias")}
    return names


def _wb(src: str, dst: str) -> dict[str, str]:
    return {f"{src}.{p}": f"{dst}.{p}" for p in ("weight", "bias")}


@dataclass(frozen=True)
class Family:
    """How one model family's Megatron names map onto ours."""

    name: str
    layer_prefix: str  # ours, formatted with the layer number
    top: dict[str, str]  # Megatron name outside the layers -> ours
    word_embedding: str  # ours
    position_embedding: str  # ours


LAYER_NAMES = _layer_names()
"""Megatron name inside a layer (legacy and megatron-core) -> ours inside a layer."""
HEAD_NAMES = ("word_embeddings_for_head.weight", "output_layer.weight", "language_model.output_layer.weight")
"""The output layer's weight: a copy of the word embedding (last pipeline stage) unless untied."""
GPT = Family("gpt", "transformer.h.{}.", {
    **{f"{prefix}embedding.word_embeddings.weight": "transformer.wte.weight" for prefix in ("language_model.", "")},
    **{f"{prefix}embedding.position_embeddings.weight": "transformer.wpe.weight" for prefix in ("language_model.", "")},
    **{k: v for stack in _STACKS for k, v in _wb(f"{stack}.final_layernorm", "transformer.ln_f").items()}},
    "transformer.wte.weight", "transformer.wpe.weight")
BERT = Family("bert", "layers.{}.", {  # legacy (`language_model.`, lm_head.layernorm or .norm, lm_head.bias), core
    **{f"{prefix}embedding.{kind}_embeddings.weight": f"embeddings.{ours}.weight" for prefix in ("language_model.", "")
       for kind, ours in (("word", "word"), ("position", "position"), ("tokentype", "tokentype"))},
    **{k: v for stack in _STACKS for k, v in _wb(f"{stack}.final_layernorm", "ln_f").items()},
    **_wb("language_model.pooler.dense", "pooler"), **_wb("pooler.dense", "pooler"),
    **_wb("lm_head.dense", "lm_head.dense"), **_wb("lm_head.layernorm", "lm_head.ln"),
    **_wb("lm_head.norm", "lm_head.ln"), **_wb("lm_head.layer_norm", "lm_head.ln"),
    "lm_head.bias": "lm_head.bias", "output_layer.bias": "lm_head.bias",
    **_wb("binary_head", "sop_head")},
    "embeddings.word.weight", "embeddings.position.weight")


def family_of(state: dict) -> Family:
    """BERT when the last stage holds BERT's heads or the first its token-type embedding, else GPT."""
    bert = ("lm_head.", "binary_head.", "language_model.pooler.", "pooler.", "language_model.embedding.tokentype_",
            "embedding.tokentype_", "encoder.layers.")
    return BERT if any(name.startswith(bert) for name in state) else GPT


# ---- architecture and configuration -----------------------------------------------------------------

def architecture_problems(args) -> list[str]:
    """What the saved training arguments say our models do not implement (none known without arguments)."""
    if args is None:
        return []
    problems = [f"{name}=True ({why})" for name, why in (
        ("swiglu", "a SwiGLU MLP; ours is GeLU"), ("squared_relu", "a squared-ReLU MLP"),
        ("apply_residual_connection_post_layernorm",
         "residuals taken after the layer norm; ours are taken before it, as GPT-2's and the paper's BERT's"),
        ("untie_embeddings_and_output_weights", "an output layer of its own; ours is tied to the input embedding"),
        ("group_query_attention", "grouped-query attention"), ("qk_layernorm", "layer norms on queries and keys"))
        if getattr(args, name, False) is True]
    if getattr(args, "add_bias_linear", True) is False:
        problems.append("add_bias_linear=False (linear layers without biases)")
    if getattr(args, "add_position_embedding", True) is False:
        problems.append("add_position_embedding=False (no learned position embeddings)")
    position = getattr(args, "position_embedding_type", None)
    if isinstance(position, str) and position != "learned_absolute":
        problems.append(f"position_embedding_type={position!r} (ours are learned absolute position embeddings)")
    if getattr(args, "normalization", "LayerNorm") not in (None, "LayerNorm"):
        problems.append(f"normalization={args.normalization!r} (ours is LayerNorm)")
    if getattr(args, "num_experts", None):
        problems.append(f"num_experts={args.num_experts} (a mixture of experts)")
    return problems


def gelu_forms(args, override: str | None = None, core: bool = False) -> tuple[str, str]:
    """(the MLP's, BERT's masked-LM head's) GeLU form as Megatron-LM computed them. Its fused bias-GeLU
    computes the tanh form, plain F.gelu the erf form. Legacy models (`core` False): --openai-gelu is
    tanh too, and the LM head never fuses; without saved arguments, or without these switches in them,
    tanh (2019's code used OpenAI's GeLU). megatron-core ignores --openai-gelu: its MLP is tanh with
    the fusion (Megatron-LM's default) and erf without, its BertLMHead always F.gelu (erf)."""
    if override:
        return override, override
    openai = getattr(args, "openai_gelu", None)
    fused = [getattr(args, s) for s in ("bias_gelu_fusion", "bias_activation_fusion")
             if getattr(args, s, None) is not None]
    if core:
        return ("tanh" if any(fused) or not fused else "erf"), "erf"
    if openai is None and not fused:
        return "tanh", "tanh"
    return ("tanh" if openai or any(fused) else "erf"), ("tanh" if openai else "erf")


def _saved_gelu(family: Family, args, core: bool) -> tuple[str, ...] | None:
    """The GeLU forms the saved arguments say (the MLP's; a BERT's LM head's too), None where they say none."""
    said = any(getattr(args, s, None) is not None for s in ("bias_gelu_fusion", "bias_activation_fusion"))
    if not (said or (not core and getattr(args, "openai_gelu", None) is not None)):
        return None
    forms = gelu_forms(args, None, core)
    return forms if family is BERT else forms[:1]


def _check_options(family: Family, args, opts: ImportOptions, core: bool) -> None:
    """A MegatronFormatError for an option that is not positive, or that contradicts the saved arguments."""
    for flag, value in (("--num-attention-heads", opts.num_attention_heads), ("--vocab-size", opts.vocab_size),
                        ("--make-vocab-size-divisible-by", opts.make_vocab_size_divisible_by)):
        if value is not None and value <= 0:
            raise MegatronFormatError(f"{flag} {value} is not a positive count. Fix: give a positive number, or "
                                      "leave it out to read it from the checkpoint")
    saved_vocab = _saved_vocab_size(family, args)
    if opts.vocab_size is not None and saved_vocab is not None and opts.vocab_size != saved_vocab:
        raise MegatronFormatError(f"--vocab-size {opts.vocab_size} differs from the checkpoint's {saved_vocab} (its "
                                  "saved arguments): drop it")
    saved = _saved_gelu(family, args, core)
    if opts.gelu and saved is not None and saved != (opts.gelu,) * len(saved):
        raise MegatronFormatError(f"--gelu {opts.gelu} differs from the checkpoint's {' and '.join(dict.fromkeys(saved))} "
                                  "(its saved arguments say it): drop it")


def _saved_vocab_size(family: Family, args) -> int | None:
    """The vocabulary the saved arguments say: their vocab_size, else a GPT's GPT-2 BPE by its tokenizer
    type; None where they say none (a BERT's WordPiece type may read a vocabulary file of any size)."""
    if (saved := _arg(args, "vocab_size")) is not None:
        return saved
    return GPT2_TOKENS if family is GPT and _arg(args, "tokenizer_type") == "GPT2BPETokenizer" else None


def is_core(state: dict) -> bool:
    """Whether a rank file's model state has megatron-core's names (`decoder.`/`encoder.` layers, where
    the legacy models nest theirs under `language_model.`)."""
    return any(name.startswith(("decoder.", "encoder.")) for name in state)


ZERO_CENTERED = ("apply_layernorm_1p", "layernorm_zero_centered_gamma")
"""Saved switches under which each layer norm stores gamma - 1 (and computes with weight + 1)."""
_NORM_WEIGHT = re.compile(r"(?:^|\.)(?:ln_1|ln_2|ln_f)\.weight$")


def zero_centered(args) -> bool:
    """Whether the run's layer norms were zero-centred (--apply-layernorm-1p, layernorm_zero_centered_gamma)."""
    return any(getattr(args, name, False) is True for name in ZERO_CENTERED)


def add_one_to_layer_norms(state: dict, head_norm_centred: bool) -> None:
    """Our gamma (= Megatron's stored gamma - 1, plus 1, in the stored dtype as Megatron adds it) for
    every zero-centred layer norm of one TP rank's state. BERT's LM-head norm is one where the switch
    reached it (`head_norm_centred`): in megatron-core and in the later legacy head's `norm`
    (`get_norm`), not in the earlier legacy head's `layernorm`, a plain LayerNorm."""
    for name in list(state):
        if _NORM_WEIGHT.search(name) or (head_norm_centred and name == "lm_head.ln.weight"):
            state[name] = state[name] + 1


def _arg(args, *names: str, default=None):
    values = [getattr(args, n) for n in names if getattr(args, n, None) is not None]
    return values[0] if values else default


def _vocab_size(family: Family, args, rows: int, tp: int, vocab_size: int | None) -> int:
    """The real vocabulary under Megatron's padded rows: given, else the tokenizer's (GPT: the saved
    `vocab_size`, as export-megatron writes the model's, else GPT-2's BPE; BERT: the saved tokenizer
    type's WordPiece, else the one whose Megatron padding gives `rows`)."""
    tokenizer = _arg(args, "tokenizer_type")
    if family is GPT:
        if tokenizer not in (None, "GPT2BPETokenizer"):
            raise MegatronFormatError(f"tokenizer_type={tokenizer!r}: this project reads and evaluates GPT with "
                                      f"GPT-2's BPE ({GPT2_TOKENS} tokens), so another vocabulary cannot be imported")
        return vocab_size or _arg(args, "vocab_size") or GPT2_TOKENS
    if tokenizer is not None and tokenizer not in BERT_TOKENIZERS:
        raise MegatronFormatError(f"tokenizer_type={tokenizer!r}: a BERT here uses a WordPiece vocabulary "
                                  f"({', '.join(BERT_TOKENIZERS)})")
    if vocab_size or tokenizer:
        return vocab_size or BERT_TOKENIZERS[tokenizer]
    padding = _arg(args, "make_vocab_size_divisible_by", default=128) * tp
    fits = [n for n in BERT_TOKENIZERS.values() if -(-n // padding) * padding == rows]
    if len(fits) != 1:
        raise MegatronFormatError(f"{rows} word-embedding rows and no saved tokenizer type: give --vocab-size "
                                  "(30522 for the uncased WordPiece vocabulary, 28996 for the cased)")
    return fits[0]


@dataclass
class ImportOptions:
    """What the checkpoint may not say itself."""

    num_attention_heads: int | None = None
    vocab_size: int | None = None
    gelu: str | None = None  # "tanh" | "erf"
    make_vocab_size_divisible_by: int = 1024  # our padding unit (Megatron's padded rows are dropped)


def model_config(family: Family, args, state: dict, num_layers: int, tp: int, opts: ImportOptions,
                 core: bool = False) -> ModelConfig:
    """Our config from TP rank 0's (stage-merged) state and the saved arguments, if any (`core`: the
    file has megatron-core's names)."""
    _check_options(family, args, opts, core)
    saved_heads = _arg(args, "num_attention_heads")
    heads = opts.num_attention_heads or saved_heads
    if heads is None:
        raise MegatronFormatError("the checkpoint holds no training arguments (an early release): give "
                                  "--num-attention-heads (16 for NVIDIA's 345M GPT-2 and BERT)")
    if saved_heads is not None and heads != saved_heads:
        raise MegatronFormatError(f"--num-attention-heads {heads} differs from the checkpoint's {saved_heads}: drop it")
    for name in (family.word_embedding, family.position_embedding):
        if name not in state:
            what = "word" if name == family.word_embedding else "learned position"
            raise MegatronFormatError(f"the checkpoint has no {what} embeddings, which our models need "
                                      "(rotary or ALiBi position encodings are not implemented)")
    words, positions = state[family.word_embedding], state[family.position_embedding]
    mlp_gelu, head_gelu = gelu_forms(args, opts.gelu, core)
    cfg = ModelConfig(num_layers=num_layers, hidden_size=words.shape[1], num_attention_heads=heads,
                      seq_length=positions.shape[0],
                      vocab_size=_vocab_size(family, args, words.shape[0] * tp, tp, opts.vocab_size),
                      make_vocab_size_divisible_by=opts.make_vocab_size_divisible_by,
                      hidden_dropout=_arg(args, "hidden_dropout", default=0.1),
                      attention_dropout=_arg(args, "attention_dropout", default=0.1),
                      init_method_std=_arg(args, "init_method_std", default=0.02),
                      layernorm_epsilon=_arg(args, "layernorm_epsilon", "norm_epsilon", default=1e-5), gelu=mlp_gelu)
    if family is BERT:
        from repro.models.bert import BertConfig

        tokentypes = state.get("embeddings.tokentype.weight")
        cfg = BertConfig(**{**cfg.__dict__, "num_tokentypes": 0 if tokentypes is None else tokentypes.shape[0],
                            "layernorm_order": "pre", "lm_head_gelu": head_gelu})
    return cfg


# ---- parameters -------------------------------------------------------------------------------------

def rename_stages(family: Family, stages: list[dict], where: str) -> tuple[dict, torch.Tensor | None, int]:
    """One TP rank's pipeline stages (in order) -> (our names, the output layer's weight if saved,
    layer count); each stage's local layer numbers are offset by the layers of the stages before it."""
    ours, head, offset, unknown = {}, None, 0, []
    for state in stages:
        layers = set()
        for name, tensor in state.items():
            layer = _LAYER.match(name)
            if name in family.top:
                ours[family.top[name]] = tensor
            elif name in HEAD_NAMES:
                head = tensor
            elif layer and layer[2] in LAYER_NAMES:
                layers.add(int(layer[1]))
                ours[family.layer_prefix.format(offset + int(layer[1])) + LAYER_NAMES[layer[2]]] = tensor
            else:
                unknown.append(name)
        offset += len(layers)
    if unknown:
        raise MegatronFormatError(f"{where}: parameters our {family.name.upper()} has no counterpart for, "
                                  f"{unknown[:6]}: a different architecture")
    return ours, head, offset


def qkv_to_ours(tensor: torch.Tensor, version: float, heads: int) -> torch.Tensor:
    """One TP rank's fused QKV rows (weight or bias, `heads` of them on this rank) in our [3, np, hn]
    order from the checkpoint version's: 0 [3, np, hn], 1.0 [np, hn, 3], 2.0 and later [np, 3, hn]."""
    rest = tensor.shape[1:]
    trailing = tuple(range(3, 3 + len(rest)))
    if version == 0:
        return tensor
    if version == 1:
        return tensor.reshape(heads, -1, 3, *rest).permute(2, 0, 1, *trailing).reshape(tensor.shape)
    return tensor.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(tensor.shape)


BINARY_HEAD_PARTS = ("embeddings.tokentype.weight", "pooler.weight", "pooler.bias", "sop_head.weight", "sop_head.bias")
"""What Megatron-LM builds only with BERT's binary head: --bert-no-binary-head leaves them all out."""


def add_fresh_binary_head(state: dict, std: float) -> list[str]:
    """Add to one TP rank's state the binary-head parts it lacks: zero token-type embeddings for our two
    segments (adding zeros leaves the model's function as Megatron ran it), and a pooler and SOP head
    drawn as Megatron initialises them (N(0, std) weights, zero biases; the same on every rank).
    Returns the names added."""
    h, generator = state[BERT.word_embedding].shape[1], torch.Generator().manual_seed(1234)
    fresh = {"embeddings.tokentype.weight": torch.zeros(2, h)}
    for name, rows in (("pooler", h), ("sop_head", 2)):
        fresh |= {f"{name}.weight": torch.randn(rows, h, generator=generator) * std, f"{name}.bias": torch.zeros(rows)}
    added = [name for name in BINARY_HEAD_PARTS if name not in state]
    state |= {name: fresh[name] for name in added}
    return added


def complete_binary_head(path, family: Family, args, shards: list[dict]) -> None:
    """Fresh binary-head parts, with a warning, for a BERT saved without its binary (sentence-order) head
    as --bert-no-binary-head trains it; a MegatronFormatError if its arguments say it has one."""
    if family is not BERT or BERT.word_embedding not in shards[0] or any("sop_head.weight" in s for s in shards):
        return
    if getattr(args, "bert_binary_head", None) is True:
        raise MegatronFormatError(f"{path}: the saved arguments say bert_binary_head=True but no rank file holds "
                                  "binary_head: an incomplete checkpoint (give every pipeline stage's files)")
    added = [add_fresh_binary_head(state, _arg(args, "init_method_std", default=0.02)) for state in shards][0]
    zeros = " (token types as zeros: the masked-LM logits are Megatron's)" if added[0].startswith("embeddings.") else ""
    warnings.warn(f"{path}: no binary (sentence-order) head, as --bert-no-binary-head (bert_binary_head=False) "
                  f"trains a BERT: imported with {', '.join(added)} freshly initialised{zeros}. Fine-tuning "
                  "(`repro finetune race`) trains the pooler; the SOP logits mean nothing until trained",
                  stacklevel=3)


@dataclass
class MegatronModel:
    """A Megatron-LM checkpoint read into our names: the family, the config and each TP rank's state in
    our per-rank layout (QKV rows [q | k | v] of the rank's heads; vocabulary rows as Megatron padded them)."""

    family: str
    config: ModelConfig
    shards: list[dict]
    provenance: dict


def read_megatron(path: str | Path, opts: ImportOptions | None = None) -> MegatronModel:
    """Read every rank file of a Megatron-LM GPT or BERT checkpoint; MegatronFormatError names what does not fit."""
    opts = opts or ImportOptions()
    found = locate(path)
    first = load_rank_file(found.files[(0, 0)])
    args, version = first.get("args"), float(first.get("checkpoint_version", 0))
    problems = architecture_problems(args)
    if problems:
        raise MegatronFormatError(f"{path}: the model uses what ours do not implement: " + "; ".join(problems))
    saved = (_arg(args, "tensor_model_parallel_size", "model_parallel_size", default=found.tp),
             _arg(args, "pipeline_model_parallel_size", default=found.pp))
    if saved != (found.tp, found.pp):
        raise MegatronFormatError(f"{path}: the run was TP={saved[0]} x PP={saved[1]} but {found.tp * found.pp} rank "
                                  f"file(s) were found: give the whole checkpoint directory")
    family, core, shards, layers, head_norm_centred = _read_shards(path, found, first)
    complete_binary_head(path, family, args, shards)
    cfg = model_config(family, args, shards[0], layers, found.tp, opts, core)
    _check_shapes(family, cfg, shards, found.tp)
    for state in shards:
        for name in [n for n in state if ".attn.c_attn." in n]:
            state[name] = qkv_to_ours(state[name], version, cfg.num_attention_heads // found.tp)
        if zero_centered(args):
            add_one_to_layer_norms(state, head_norm_centred)
    provenance = {"megatron_checkpoint_version": version, "megatron_iteration": first.get("iteration", found.iteration),
                  "megatron_tp": found.tp, "megatron_pp": found.pp}
    return MegatronModel(family.name, cfg, shards, provenance)


def _read_shards(path, found, first: dict) -> tuple[Family, bool, list[dict], int, bool]:
    """(family, whether megatron-core names, each TP rank's stage-merged state in our names, layer count,
    whether BERT's LM-head norm follows --apply-layernorm-1p: megatron-core's and the later legacy `norm`)."""
    shards, layers, family, core, head_norm_centred = [], None, None, False, False
    progress = tqdm(total=found.tp * found.pp, desc="read rank files", unit="file", disable=found.tp * found.pp < 2)
    for t in range(found.tp):
        stages = []
        for p in range(found.pp):
            stages.append(model_state(first if (t, p) == (0, 0) else load_rank_file(found.files[t, p]),
                                      found.files[t, p]))
            progress.update()
        if family is None:
            family, core = family_of({k: v for s in stages for k, v in s.items()}), any(map(is_core, stages))
            head_norm_centred = core or any("lm_head.norm.weight" in s for s in stages)
        state, head, count = rename_stages(family, stages, str(found.files[t, 0].parent))
        if layers is not None and count != layers:
            raise MegatronFormatError(f"{path}: TP rank {t} holds {count} layers, rank 0 {layers}: a damaged checkpoint")
        layers = count
        if head is not None and not torch.equal(head, state.get(family.word_embedding, head)):
            raise MegatronFormatError(f"{path}: the output layer's weight differs from the word embedding's: ours "
                                      "are tied, as GPT-2's, BERT's and Megatron-LM's default are")
        shards.append(state)
    progress.close()
    return family, core, shards, layers, head_norm_centred


def _check_shapes(family: Family, cfg: ModelConfig, shards: list[dict], tp: int) -> None:
    """Every parameter of our model present, with the shape a TP=`tp` Megatron shard of it has."""
    from repro.models.bert import BERT as BertModel
    from repro.models.gpt import GPT as GptModel

    cfg.validate(tp)
    with torch.device("meta"):
        expected = (BertModel if family is BERT else GptModel)(cfg).state_dict()
    h, layer = cfg.hidden_size, family.layer_prefix.format(0)
    for rank, state in enumerate(shards):
        missing = sorted(set(expected) - set(state))
        if missing:
            raise MegatronFormatError(f"TP rank {rank} lacks {missing[:4]} ({len(missing)} in all): linear layers "
                                      "without biases, or another architecture, cannot be imported")
        qkv, fc = state[layer + "attn.c_attn.weight"], state[layer + "mlp.c_fc.weight"]
        if qkv.shape != (3 * h // tp, h):
            raise MegatronFormatError(f"fused QKV weight of shape {tuple(qkv.shape)} on TP rank {rank}, not "
                                      f"({3 * h // tp}, {h}): grouped-query attention or kv_channels != h / heads")
        if fc.shape != (4 * h // tp, h):
            raise MegatronFormatError(f"MLP weight of shape {tuple(fc.shape)} on TP rank {rank}, not ({4 * h // tp}, "
                                      f"{h}): our MLP is 4h wide (ffn_hidden_size = 4 x hidden_size)")
        if state[family.word_embedding].shape[0] * tp < cfg.vocab_size:
            raise MegatronFormatError(f"{state[family.word_embedding].shape[0] * tp} embedding rows, fewer than the "
                                      f"vocabulary's {cfg.vocab_size} tokens")
