"""Read a Megatron-LM GPT checkpoint (its `torch` format) as this project's TP=1 GPT state dict.

    repro checkpoint import-megatron /ckpts/gpt2_345m --out runs/megatron-345m --tp 2

Layout (Megatron-LM's checkpointing.py): DIR/latest_checkpointed_iteration.txt holds `release` or an
iteration and so names DIR/release/ or DIR/iter_0000500/, which holds one folder per model-parallel
rank, mp_rank_{tp:02d}/model_optim_rng.pt, or mp_rank_{tp:02d}_{pp:03d}/... with pipeline stages
(each stage numbers its layers from 0). A folder holding the mp_rank_* folders, or one
model_optim_rng.pt of a TP=1, PP=1 run, is read too. 8 TP ranks x 2 stages: 16 files, merged here.

Both model generations' names are read: the legacy `language_model.{embedding, transformer|encoder}`
(2019 on) and megatron-core's `embedding`, `decoder` (local and Transformer Engine layer specs). Each
TP rank's fused query/key/value rows are ordered by the file's `checkpoint_version`: 0 (2019) as
[3, np, hn] (this GPT's order), 1.0 as [np, hn, 3], 2.0 and 3.0 as [np, 3, hn] (np: that rank's
heads, hn: the head size). The weights are the model's own (fp16/bf16 when trained so), as Megatron
evaluates them; optimizer state is not read. The GeLU form (tanh or erf) follows the saved arguments.
Architectures this GPT lacks are refused by name.
"""

from __future__ import annotations

import argparse
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from repro.models.config import ModelConfig

GPT2_TOKENS = 50257
TRACKER = "latest_checkpointed_iteration.txt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
_LAYER = re.compile(r"^(?:language_model\.(?:transformer|encoder)|decoder)\.layers\.(\d+)\.(.+)$")
_TO_TORCH_FORMAT = ("re-save it in Megatron-LM's `torch` format: launch its training script with --load DIR "
                    "--ckpt-convert-format torch --ckpt-convert-save NEW_DIR, then import NEW_DIR")


class MegatronFormatError(ValueError):
    """A Megatron-LM checkpoint this GPT cannot be built from; the message names the problem and the fix."""


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


LAYER_NAMES = _layer_names()
"""Megatron name inside a layer (legacy and megatron-core) -> ours inside transformer.h.N."""
TOP_NAMES = {f"{prefix}{src}": dst for prefix in ("language_model.", "")
             for src, dst in (("embedding.word_embeddings.weight", "transformer.wte.weight"),
                              ("embedding.position_embeddings.weight", "transformer.wpe.weight"))} | {
    f"{stack}.final_layernorm.{p}": f"transformer.ln_f.{p}" for p in ("weight", "bias")
    for stack in ("language_model.transformer", "language_model.encoder", "decoder")}
HEAD_NAMES = ("word_embeddings_for_head.weight", "output_layer.weight", "language_model.output_layer.weight")


@dataclass(frozen=True)
class MegatronFiles:
    """The model_optim_rng.pt of every (tp_rank, pp_rank) of one saved iteration."""

    files: dict[tuple[int, int], Path]
    iteration: str  # "release", an iteration number, or "" when no tracker file named it

    @property
    def tp(self) -> int:
        return 1 + max(t for t, _ in self.files)

    @property
    def pp(self) -> int:
        return 1 + max(p for _, p in self.files)


def locate(path: str | Path) -> MegatronFiles:
    """The rank files of a Megatron-LM checkpoint directory (or of one .pt file)."""
    path = Path(path)
    if path.is_file():
        if path.suffix == ".zip":
            raise MegatronFormatError(f"{path} is a zip archive: unzip it (unzip {path.name} -d DIR) and import DIR")
        return MegatronFiles({(0, 0): path}, "")
    if not path.is_dir():
        raise MegatronFormatError(f"{path} does not exist: give a Megatron-LM checkpoint directory (the --save "
                                  f"directory holding {TRACKER}) or one model_optim_rng.pt")
    path, iteration = _iteration_folder(path)
    _refuse_distributed(path)
    files = {}
    for folder in path.iterdir() if path.is_dir() else ():
        match = _RANK_DIR.match(folder.name)
        if match and (folder / "model_optim_rng.pt").is_file():
            files[(int(match[1]), int(match[2] or 0))] = folder / "model_optim_rng.pt"
    if not files:
        raise MegatronFormatError(f"{path} holds no mp_rank_*/model_optim_rng.pt: give the directory Megatron-LM "
                                  f"saved to (with {TRACKER}), one iteration's folder, or one .pt file")
    found = MegatronFiles(files, iteration)
    missing = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if found.pp > 1 else "")
               for t in range(found.tp) for p in range(found.pp) if (t, p) not in files]
    if missing:
        raise MegatronFormatError(f"{path} lacks {', '.join(missing)} of a TP={found.tp} x PP={found.pp} "
                                  "checkpoint: copy every rank's folder")
    return found


def _iteration_folder(path: Path) -> tuple[Path, str]:
    """The folder of rank folders that PATH's tracker file names (else PATH, or its lone release/)."""
    if (path / TRACKER).is_file():
        iteration = (path / TRACKER).read_text().strip()
        if iteration != "release" and not iteration.isdigit():
            raise MegatronFormatError(f"{path / TRACKER} holds {iteration!r}, neither 'release' nor an iteration")
        return path / ("release" if iteration == "release" else f"iter_{int(iteration):07d}"), iteration
    if any(_RANK_DIR.match(p.name) for p in path.iterdir()):
        return path, ""
    if (path / "release").is_dir():  # NVIDIA's release zips hold release/mp_rank_00/ only
        return path / "release", "release"
    saved = sorted(p.name for p in path.glob("iter_*"))
    if saved:
        raise MegatronFormatError(f"{path} has no {TRACKER} naming one of its iterations: import one of "
                                  f"{', '.join(saved[-3:])} (e.g. {path / saved[-1]})")
    return path, ""


def _refuse_distributed(path: Path) -> None:
    if (path / ".metadata").exists() or (path / "common.pt").exists() or any(path.glob("*.distcp")):
        raise MegatronFormatError(f"{path} is a torch_dist (distributed) checkpoint, which needs Megatron-LM to "
                                  f"read: {_TO_TORCH_FORMAT}")


class _Opaque:
    """Stands in for a class the checkpoint pickled but an import does not need (Megatron's enums and
    loss scalers, Transformer Engine's extra state, numpy RNG states): it keeps what it was given."""

    def __init__(self, *args, **kwargs) -> None:
        self.args = args

    def __setstate__(self, state) -> None:
        self.state = state


def load_rank_file(path: Path) -> dict:
    """torch.load(weights_only=True) with argparse.Namespace allowed and every other class the file
    names replaced by an inert placeholder: nothing in the file runs and Megatron need not be installed."""
    allowed: list = [argparse.Namespace]
    try:  # the zip format lists its classes up front; the pre-1.6 format is learned one error at a time
        allowed += [_placeholder(name) for name in torch.serialization.get_unsafe_globals_in_checkpoint(path)
                    if name != "argparse.Namespace"]
    except Exception:  # noqa: BLE001 - the legacy format, or a torch without the function
        pass
    for _ in range(100):
        try:
            with torch.serialization.safe_globals(allowed):
                return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            name = re.search(r"GLOBAL ([\w.]+)", str(err))
            if name is None or any(isinstance(a, tuple) and a[1] == name[1] for a in allowed):
                raise MegatronFormatError(f"{path}: cannot unpickle ({str(err).splitlines()[0]})") from None
            allowed.append(_placeholder(name[1]))
    raise MegatronFormatError(f"{path}: names over 100 classes; it is not a Megatron-LM checkpoint")


def _placeholder(qualified_name: str) -> tuple[type, str]:
    return type(qualified_name.rsplit(".", 1)[-1], (_Opaque,), {}), qualified_name


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    """Nested state dicts (the legacy `language_model` -> `embedding` -> ...) as dotted names."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        flat |= flatten(value, name + ".") if isinstance(value, dict) else {name: value}
    return flat


def model_state(saved: dict, path: Path) -> dict[str, torch.Tensor]:
    """The flat model state of one rank file (tensors only: Transformer Engine's extra state dropped)."""
    if "model" not in saved:
        chunks = sorted(k for k in saved if re.fullmatch(r"model\d+", str(k)))
        hint = (f"it holds {', '.join(chunks)} (interleaved pipeline stages): re-save it with one model chunk per "
                "stage (Megatron-LM's tools/checkpoint, target pipeline size 1)") if chunks else \
            f"its keys are {sorted(map(str, saved))[:8]}"
        raise MegatronFormatError(f"{path} has no 'model' entry: {hint}")
    return {k: v for k, v in flatten(saved["model"]).items()
            if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}


# ---- architecture and configuration -----------------------------------------------------------------

def architecture_problems(args) -> list[str]:
    """What the saved training arguments say this GPT does not implement (none known without arguments)."""
    if args is None:
        return []
    problems = [f"{name}=True ({why})" for name, why in (
        ("swiglu", "a SwiGLU MLP; this GPT's MLP is GeLU"), ("squared_relu", "a squared-ReLU MLP"),
        ("apply_residual_connection_post_layernorm", "residuals taken after the layer norm; GPT-2 takes them before"),
        ("untie_embeddings_and_output_weights", "an output layer of its own; this GPT ties it to the input embedding"),
        ("group_query_attention", "grouped-query attention"), ("qk_layernorm", "layer norms on queries and keys"))
        if getattr(args, name, False) is True]
    if getattr(args, "add_bias_linear", True) is False:
        problems.append("add_bias_linear=False (linear layers without biases)")
    if getattr(args, "add_position_embedding", True) is False:
        problems.append("add_position_embedding=False (no learned position embeddings)")
    position = getattr(args, "position_embedding_type", None)
    if isinstance(position, str) and position != "learned_absolute":
        problems.append(f"position_embedding_type={position!r} (this GPT learns absolute position embeddings)")
    if getattr(args, "normalization", "LayerNorm") not in (None, "LayerNorm"):
        problems.append(f"normalization={args.normalization!r} (this GPT uses LayerNorm)")
    if getattr(args, "num_experts", None):
        problems.append(f"num_experts={args.num_experts} (a mixture of experts)")
    return problems


def gelu_forms(args, override: str | None = None) -> tuple[str, str]:
    """(the MLP's, BERT's masked-LM head's) GeLU form as Megatron-LM computed them: its fused bias-GeLU
    and --openai-gelu compute the tanh form, plain F.gelu the erf form (the LM head never fuses). Without
    saved arguments, or without these switches in them, tanh (2019's code used OpenAI's GeLU)."""
    if override:
        return override, override
    openai = getattr(args, "openai_gelu", None)
    fused = [getattr(args, s) for s in ("bias_gelu_fusion", "bias_activation_fusion") if getattr(args, s, None) is not None]
    if openai is None and not fused:
        return "tanh", "tanh"
    return ("tanh" if openai or any(fused) else "erf"), ("tanh" if openai else "erf")


def _arg(args, *names: str, default=None):
    values = [getattr(args, n) for n in names if getattr(args, n, None) is not None]
    return values[0] if values else default


def model_config(args, state: dict, num_layers: int, num_attention_heads: int | None,
                 make_vocab_size_divisible_by: int, gelu: str | None = None) -> ModelConfig:
    """Our ModelConfig from TP rank 0's (merged-stage) state and the saved arguments, if any."""
    saved_heads = _arg(args, "num_attention_heads")
    heads = num_attention_heads or saved_heads
    if heads is None:
        raise MegatronFormatError("the checkpoint holds no training arguments (an early release): give "
                                  "--num-attention-heads (16 for NVIDIA's GPT-2 345M)")
    if saved_heads is not None and heads != saved_heads:
        raise MegatronFormatError(f"--num-attention-heads {heads} differs from the checkpoint's {saved_heads}: drop it")
    tokenizer = _arg(args, "tokenizer_type")
    if tokenizer not in (None, "GPT2BPETokenizer"):
        raise MegatronFormatError(f"tokenizer_type={tokenizer!r}: this project reads and evaluates GPT with GPT-2's "
                                  f"BPE ({GPT2_TOKENS} tokens), so a model of another vocabulary cannot be imported")
    for name in ("transformer.wte.weight", "transformer.wpe.weight"):
        if name not in state:
            what = "word" if "wte" in name else "learned position"
            raise MegatronFormatError(f"the checkpoint has no {what} embeddings: this GPT needs GPT-2's "
                                      "(rotary or ALiBi position encodings are not implemented)")
    wte, wpe = state["transformer.wte.weight"], state["transformer.wpe.weight"]
    return ModelConfig(num_layers=num_layers, hidden_size=wte.shape[1], num_attention_heads=heads,
                       seq_length=wpe.shape[0], vocab_size=GPT2_TOKENS,
                       make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                       hidden_dropout=_arg(args, "hidden_dropout", default=0.1),
                       attention_dropout=_arg(args, "attention_dropout", default=0.1),
                       init_method_std=_arg(args, "init_method_std", default=0.02),
                       layernorm_epsilon=_arg(args, "layernorm_epsilon", "norm_epsilon", default=1e-5),
                       gelu=gelu_forms(args, gelu)[0])


# ---- parameters -------------------------------------------------------------------------------------

def rename_stages(stages: list[dict], where: str) -> tuple[dict, torch.Tensor | None, int]:
    """One TP rank's pipeline stages (in order) -> (our names, the output layer's weight if saved,
    layer count); each stage's local layer numbers are offset by the layers of the stages before it."""
    ours, head, offset, unknown = {}, None, 0, []
    for state in stages:
        layers = set()
        for name, tensor in state.items():
            layer = _LAYER.match(name)
            if name in TOP_NAMES:
                ours[TOP_NAMES[name]] = tensor
            elif name in HEAD_NAMES:
                head = tensor
            elif layer and layer[2] in LAYER_NAMES:
                layers.add(int(layer[1]))
                ours[f"transformer.h.{offset + int(layer[1])}.{LAYER_NAMES[layer[2]]}"] = tensor
            else:
                unknown.append(name)
        offset += len(layers)
    if unknown:
        kind = "a BERT checkpoint (import-megatron reads GPT)" if any("lm_head" in n or "binary_head" in n
                                                                       for n in unknown) else "not GPT-2's architecture"
        raise MegatronFormatError(f"{where}: parameters this GPT has no counterpart for, {unknown[:6]}: {kind}")
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


@dataclass
class MegatronGPT:
    """A Megatron-LM GPT checkpoint read into our names: the config and each TP rank's state, in our
    per-rank layout (QKV rows [q | k | v] of the rank's heads; vocabulary rows as Megatron padded them)."""

    config: ModelConfig
    shards: list[dict]
    provenance: dict


def read_megatron_gpt(path: str | Path, num_attention_heads: int | None = None,
                      make_vocab_size_divisible_by: int = 1024, gelu: str | None = None) -> MegatronGPT:
    """Read every rank file of a Megatron-LM GPT checkpoint; MegatronFormatError names what does not fit."""
    found = locate(path)
    first = load_rank_file(found.files[(0, 0)])
    args, version = first.get("args"), float(first.get("checkpoint_version", 0))
    problems = architecture_problems(args)
    if problems:
        raise MegatronFormatError(f"{path}: the model uses what this GPT does not implement: " + "; ".join(problems))
    saved = (_arg(args, "tensor_model_parallel_size", "model_parallel_size", default=found.tp),
             _arg(args, "pipeline_model_parallel_size", default=found.pp))
    if saved != (found.tp, found.pp):
        raise MegatronFormatError(f"{path}: the run was TP={saved[0]} x PP={saved[1]} but {found.tp * found.pp} rank "
                                  f"file(s) were found: give the whole checkpoint directory")
    shards, layers = [], None
    for t in range(found.tp):
        stages = [model_state(first if (t, p) == (0, 0) else load_rank_file(found.files[t, p]), found.files[t, p])
                  for p in range(found.pp)]
        state, head, count = rename_stages(stages, str(found.files[t, 0].parent))
        if layers is not None and count != layers:
            raise MegatronFormatError(f"{path}: TP rank {t} holds {count} layers, rank 0 {layers}: a damaged checkpoint")
        layers = count
        if head is not None and not torch.equal(head, state.get("transformer.wte.weight", head)):
            raise MegatronFormatError(f"{path}: the output layer's weight differs from the word embedding's: this GPT "
                                      "ties them, as GPT-2 and Megatron-LM's default do")
        shards.append(state)
    cfg = model_config(args, shards[0], layers, num_attention_heads, make_vocab_size_divisible_by, gelu)
    _check_shapes(cfg, shards, found.tp)
    for state in shards:
        for name in [n for n in state if ".attn.c_attn." in n]:
            state[name] = qkv_to_ours(state[name], version, cfg.num_attention_heads // found.tp)
    provenance = {"megatron_checkpoint_version": version, "megatron_iteration": first.get("iteration", found.iteration),
                  "megatron_tp": found.tp, "megatron_pp": found.pp}
    return MegatronGPT(cfg, shards, provenance)


def _check_shapes(cfg: ModelConfig, shards: list[dict], tp: int) -> None:
    """Every parameter of our GPT present, with the shape a TP=`tp` Megatron shard of it has."""
    from repro.models.gpt import GPT

    cfg.validate(tp)
    with torch.device("meta"):
        expected = GPT(cfg).state_dict()
    h = cfg.hidden_size
    for rank, state in enumerate(shards):
        missing = sorted(set(expected) - set(state))
        if missing:
            raise MegatronFormatError(f"TP rank {rank} lacks {missing[:4]} ({len(missing)} in all): linear layers "
                                      "without biases, or a model other than GPT-2's, cannot be imported")
        qkv, fc = state["transformer.h.0.attn.c_attn.weight"], state["transformer.h.0.mlp.c_fc.weight"]
        if qkv.shape != (3 * h // tp, h):
            raise MegatronFormatError(f"fused QKV weight of shape {tuple(qkv.shape)} on TP rank {rank}, not "
                                      f"({3 * h // tp}, {h}): grouped-query attention or kv_channels != h / heads")
        if fc.shape != (4 * h // tp, h):
            raise MegatronFormatError(f"MLP weight of shape {tuple(fc.shape)} on TP rank {rank}, not ({4 * h // tp}, "
                                      f"{h}): this GPT's MLP is 4h wide (ffn_hidden_size = 4 x hidden_size)")
        if state["transformer.wte.weight"].shape[0] * tp < GPT2_TOKENS:
            raise MegatronFormatError(f"{state['transformer.wte.weight'].shape[0] * tp} embedding rows, fewer than "
                                      f"GPT-2's {GPT2_TOKENS} tokens: not a GPT-2 BPE model")
