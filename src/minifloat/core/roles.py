"""Module roles: which modules of a model are norms, embeddings, the output head and attention input projections,
and which linear layers FP8 can take. The precision policy, `mf.convert`, the stability tricks and the audit all ask
here, so they agree about every model: the reference Llama, plain MLPs and Hugging Face models alike.

* norm: torch's norm classes, or a class whose name ends in "Norm" (LlamaRMSNorm, T5LayerNorm, minifloat's
  RMSNorm, a hand-written norm; BatchNorm1d-style "Norm1d" too). Names starting with "_" (torch's weight-norm
  parametrizations) are not norms.
* embedding: nn.Embedding and nn.EmbeddingBag; a linear layer tied to one shares its weight Parameter.
* output head (`output_head`), the first rule that finds one: the last nn.Linear outside the transformer blocks
  named like HEAD_NAMES (the first name in that order that occurs: lm_head, classifier, score, head, output); the
  last nn.Linear whose weight is an embedding's (a tied head, e.g. BERT's masked-LM decoder); the last nn.Linear
  outside a pooler (a plain MLP's last layer; BertModel's last encoder projection, since sentence embeddings never
  use BERT's pooler).
* attention input projection: an nn.Linear whose own name is one of ATTENTION_INPUT_NAMES (q_proj, key, qkv, ...).
* input projections (`input_projections`), the "first layer" that mixed-precision practice keeps in high precision:
  the first nn.Linear (module order) that is neither the head nor in a pooler and, when it is an attention input
  projection, every attention input projection beside it: q, k and v read the same input, so they are one layer.
* FP8 shape (`fp8_shape_ok`): in and out features multiples of MIN_DIM_MULTIPLE.
* transformer blocks (`block_stacks`, `transformer_blocks`): the entries of the longest nn.ModuleList whose entries
  share one type and each hold an nn.Linear (the reference Llama's `blocks`, Hugging Face Llama's `model.layers`,
  BERT's `encoder.layer`), and of every other such list, not inside another list, whose blocks are of a model's own
  class and hold at least as many linears: an encoder-decoder's second stack (T5's `encoder.block` and
  `decoder.block`, Whisper's and BART's encoder and decoder layers, whatever their numbers).
  4-bit training keeps the first and last few blocks of each stack in high precision: the decoder's last block
  feeds the head, the encoder's last every cross-attention.

* wrapped layers and adapters (PEFT's convention, LoRA's among others): a layer wrapped as `<name>.base_layer` (or
  `<name>.original_module` / `<name>.modules_to_save.<adapter>`) has the role of `<name>` (`role_name`), so the
  first block's k/v projections under LoRA are still input projections and a wrapped `lm_head` is still the head.
  The other linear layers of a module holding a `base_layer` are its adapters (`adapter_linears`): low-rank and
  trained, never input projections or the head, and `mf.convert` keeps them in high precision.

* stacked matmul weights (`stacked_weights`): modules other than convolutions that hold a parameter of 3 or more
  dimensions directly, such as a mixture of experts' weights stacked as (experts, out, in) and multiplied by the
  module's own forward (transformers 5's MixtralExperts, Qwen3-MoE, DeepSeek-V3, GPT-OSS). FP8 conversion takes
  nn.Linear layers only, so these stay in high precision, and convert says so.

GPT-2's Conv1D is not an nn.Linear and has no role here.
"""

from __future__ import annotations

import math

import re

from torch import nn

MIN_DIM_MULTIPLE = 16  # FP8 tensor cores (torch._scaled_mm) need K and N divisible by 16

NORM_TYPES = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.BatchNorm1d, nn.BatchNorm2d,
              nn.BatchNorm3d, nn.SyncBatchNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
EMBEDDING_TYPES = (nn.Embedding, nn.EmbeddingBag)
CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
HEAD_NAMES = ("lm_head", "classifier", "score", "head", "output")  # in priority order
POOLER_NAMES = frozenset({"pooler"})
# own names of the projections that read an attention block's input: separate q / k / v (Llama, BERT, T5,
# DistilBERT, Meta's Llama, diffusers) and fused ones (Phi, MPT, Falcon / GPT-NeoX, nn.MultiheadAttention-style),
# DeepSeek's MLA down-projections; compared in lower case
ATTENTION_INPUT_NAMES = frozenset({
    "q_proj", "k_proj", "v_proj", "qkv_proj", "kv_proj", "query", "key", "value", "q", "k", "v", "qkv",
    "wq", "wk", "wv", "wqkv", "to_q", "to_k", "to_v", "q_lin", "k_lin", "v_lin", "c_attn", "query_key_value",
    "in_proj", "q_a_proj", "kv_a_proj_with_mqa"})

_NORM_NAME = re.compile(r"norm(\d+d)?$", re.IGNORECASE)


def is_norm_type_name(name: str) -> bool:
    """Whether a module class named `name` is a norm by name (see the module docstring)."""
    return not name.startswith("_") and _NORM_NAME.search(name) is not None


def is_norm(module: nn.Module) -> bool:
    """torch's norm classes (and their subclasses), or a class named like a norm."""
    return isinstance(module, NORM_TYPES) or is_norm_type_name(type(module).__name__)


def is_embedding(module: nn.Module) -> bool:
    return isinstance(module, EMBEDDING_TYPES)


def embedding_param_ids(model: nn.Module) -> set[int]:
    """ids of the embedding modules' parameters; a head tied to an embedding holds one of them as its weight."""
    return {id(p) for m in model.modules() if is_embedding(m) for p in m.parameters(recurse=False)}


def named_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(name, module) of every nn.Linear (subclasses such as Fp8Linear included), in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]


# a wrapper's name for the layer it wraps: PEFT's tuner layers (`base_layer`) and ModulesToSaveWrapper
# (`original_module`, and the trained copies in `modules_to_save`), nested wrappers included
_WRAPPED = re.compile(r"(?:\.(?:base_layer|original_module)|\.modules_to_save\.[^.]+)+$")


def role_name(name: str) -> str:
    """The name whose role the module called `name` has: a wrapped layer's wrapper's (see the module docstring)."""
    return _WRAPPED.sub("", name)


def own_name(name: str) -> str:
    """The last part of `role_name(name)`: "q_proj" for "...self_attn.q_proj.base_layer"."""
    return role_name(name).rpartition(".")[2]


def adapter_linears(model: nn.Module) -> set[str]:
    """Names of the adapters' nn.Linear layers: those inside a module that holds a `base_layer` (PEFT's tuner
    layers: LoRA's lora_A and lora_B), outside that base layer."""
    found = set()
    for name, m in model.named_modules():
        base = m._modules.get("base_layer")
        if not isinstance(base, nn.Module):
            continue
        prefix = f"{name}." if name else ""
        for child_name, child in m.named_children():
            if child_name != "base_layer":
                found |= {f"{prefix}{child_name}{'.' + n if n else ''}" for n, c in child.named_modules()
                          if isinstance(c, nn.Linear)}
    return found


def is_attention_input(name: str) -> bool:
    """Whether the module called `name` is, by its own name (its wrapper's, when wrapped), a projection reading an
    attention block's input."""
    return own_name(name).lower() in ATTENTION_INPUT_NAMES


def in_pooler(name: str) -> bool:
    return any(part in POOLER_NAMES for part in name.split("."))


def output_head(model: nn.Module, *, names: tuple[str, ...] = HEAD_NAMES) -> str | None:
    """The output head's module name (see the module docstring), or None for a model without nn.Linear.

    Args:
        model: any nn.Module.
        names: own names that mark the head, in priority order.
    """
    adapters = adapter_linears(model)
    linears = [(n, m) for n, m in named_linears(model) if n not in adapters]
    # a head is never inside a repeated block: a block's own `output` projection (an attention's out-projection
    # named so) does not mark the model's head
    blocks = tuple(f"{b}." for b in transformer_blocks(model))
    for marker in names:
        marked = [n for n, _ in linears if own_name(n) == marker and not n.startswith(blocks)]
        if marked:
            return marked[-1]
    embeddings = embedding_param_ids(model)
    tied = [n for n, m in linears if id(m.weight) in embeddings]
    if tied:
        return tied[-1]
    outside = [n for n, _ in linears if not in_pooler(n)]
    return outside[-1] if outside else None


def input_projections(model: nn.Module) -> list[str]:
    """The nn.Linear layers nearest the data, by name (see the module docstring): e.g. the first block's q_proj,
    k_proj and v_proj in a transformer, the first layer of an MLP."""
    head, adapters = output_head(model), adapter_linears(model)
    candidates = [n for n, _ in named_linears(model) if n != head and not in_pooler(n) and n not in adapters]
    if not candidates:
        return []
    first = candidates[0]
    if not is_attention_input(first):
        return [first]
    parent = role_name(first).rpartition(".")[0]
    return [n for n in candidates if role_name(n).rpartition(".")[0] == parent and is_attention_input(n)]


def first_and_last(model: nn.Module) -> set[str]:
    """The nn.Linear layers `keep_first_last` keeps in high precision: the input projections and the output head
    (with every copy a wrapper holds of it: PEFT's original_module beside its modules_to_save)."""
    head = output_head(model)
    heads = set() if head is None else {n for n, _ in named_linears(model) if role_name(n) == role_name(head)}
    return set(input_projections(model)) | heads


def stacked_weights(model: nn.Module) -> dict[str, tuple[tuple[str, tuple[int, ...]], ...]]:
    """{module name: ((parameter name, shape), ...)} for the modules (not convolutions) that hold parameters of 3 or
    more dimensions directly: stacked matmul weights such as MoE experts' (see the module docstring)."""
    found = {}
    convs = tuple(f"{n}." for n, m in model.named_modules() if isinstance(m, CONV_TYPES))
    for name, m in model.named_modules():
        if isinstance(m, CONV_TYPES) or name.startswith(convs):  # a conv's weight, or its parametrization's
            continue
        # (experts, out, in): a leading 1 is a single embedding-like table (ViT's class token, position embeddings)
        params = tuple((p_name, tuple(p.shape)) for p_name, p in m.named_parameters(recurse=False)
                       if p.dim() >= 3 and p.shape[0] > 1)
        if params:
            found[name] = params
    return found


def fp8_shape_ok(linear: nn.Linear) -> bool:
    """Whether FP8 GEMMs can take the layer: in and out features multiples of MIN_DIM_MULTIPLE."""
    return linear.in_features % MIN_DIM_MULTIPLE == 0 and linear.out_features % MIN_DIM_MULTIPLE == 0


def _uniform_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """(name, list) of the nn.ModuleLists whose entries share one type and each hold an nn.Linear, in module order."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.ModuleList) and len(m) and len({type(c) for c in m}) == 1
            and all(any(isinstance(s, nn.Linear) for s in c.modules()) for c in m)]


def block_stacks(model: nn.Module) -> list[list[str]]:
    """The names of the model's repeated blocks, stack by stack in module order (see the module docstring); [] for a
    model without them."""
    lists = _uniform_lists(model)
    containers = [name for name, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    # lists inside another list's entries (a block's experts, also in a list of mixed blocks) are not stacks
    outer = [(name, m) for name, m in lists
             if not any(other != name and (other == "" or name.startswith(f"{other}.")) for other in containers)]
    if not outer:
        return []
    longest = max(outer, key=lambda item: len(item[1]))[1]  # the first of the longest
    block_type, linears = type(longest[0]), _linear_count(longest[0])
    # another stack: blocks of a model's own class (a T5Block, a WhisperDecoderLayer; not a generic nn.Sequential of
    # adapters) holding at least as many linears (a decoder block adds cross-attention), whatever their number
    return [[f"{name}.{i}" if name else str(i) for i in range(len(m))] for name, m in outer
            if m is longest or (not type(m[0]).__module__.startswith("torch.") and _linear_count(m[0]) >= linears
                                and not block_type.__module__.startswith("torch."))]


def _linear_count(module: nn.Module) -> int:
    return sum(isinstance(m, nn.Linear) for m in module.modules())


def transformer_blocks(model: nn.Module) -> list[str]:
    """The names of the model's repeated blocks in module order, every stack's (see block_stacks)."""
    return [block for stack in block_stacks(model) for block in stack]


def block_count(keep: int | float, n_blocks: int) -> int:
    """A number of blocks given as a count (int) or as a fraction of `n_blocks` (float in [0, 1), rounded up: 0.15 of
    6 blocks is 1, of 62 is 10)."""
    if isinstance(keep, int):
        return keep
    return math.ceil(round(keep * n_blocks, 9))  # the round: 0.15 · 20 is 3.0000000000000004 in binary, 3 blocks


def kept_blocks(model: nn.Module, first: int | float, last: int | float) -> list[str]:
    """The names of the first `first` and the last `last` blocks of each stack of transformer blocks (counts, or
    fractions of the stack's blocks: see block_count)."""
    kept = []
    for blocks in block_stacks(model):
        head, tail = block_count(first, len(blocks)), block_count(last, len(blocks))
        kept += blocks[:head] + blocks[max(head, len(blocks) - tail):]
    return kept


def linears_in_blocks(model: nn.Module, first: int | float, last: int | float) -> set[str]:
    """The nn.Linear layers inside `kept_blocks(model, first, last)`."""
    kept = kept_blocks(model, first, last)
    return {n for n, _ in named_linears(model) if any(n.startswith(b + ".") for b in kept)}


def kept_in_fp32(model: nn.Module) -> set[str]:
    """The linears a Hugging Face model keeps in full precision (`_keep_in_fp32_modules`, e.g. T5's `wo`, matched as
    transformers matches it: a component of the module's name). Such a model's forward casts their input to their
    weight's dtype, which for stored FP8 weights would be float8: they stay in high precision."""
    wanted = getattr(model, "_keep_in_fp32_modules", None) or ()
    if isinstance(wanted, str):
        wanted = (wanted,)
    return {name for name, _ in named_linears(model) if any(w in name.split(".") for w in wanted)}
