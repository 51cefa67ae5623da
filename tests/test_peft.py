"""convert() on models whose linear layers adapters wrap (PEFT's LoRA convention: `<name>.base_layer` beside
`lora_A` / `lora_B`), in either order: convert then add adapters, or add adapters then convert.

Either way the same base layers run in FP8, the keep rules find the first block's q/k/v and the head through their
wrappers, and the adapters (low-rank, trained) stay in high precision. The first tests build the wrapper by hand (no
PEFT needed); the rest use PEFT itself on a small random Llama.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import minifloat as mf
from minifloat.core import roles
from minifloat.fp8.convert import fp8_plan

RANK = 16  # a multiple of 16: FP8's shape rule alone would convert the adapters


class Adapted(nn.Module):
    """A linear layer wrapped as PEFT's LoRA wraps one: base_layer + lora_A / lora_B (ModuleDicts by adapter name)."""

    def __init__(self, base: nn.Linear, rank: int = RANK):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, rank, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(rank, base.out_features, bias=False)})
        nn.init.zeros_(self.lora_B["default"].weight)
        base.requires_grad_(False)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


class Attention(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1) @ v)


class TinyTransformer(nn.Module):
    def __init__(self, d: int = 64, n_blocks: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(Attention(d) for _ in range(n_blocks))
        self.lm_head = nn.Linear(d, 32)

    def forward(self, x):
        for block in self.layers:
            x = x + block(x)
        return self.lm_head(x)


def adapt(model: nn.Module, own_names: set[str]) -> nn.Module:
    """Wrap every nn.Linear whose own name is in `own_names` (the way peft.get_peft_model does)."""
    for name, lin in [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]:
        parent, _, own = name.rpartition(".")
        if own in own_names:
            setattr(model.get_submodule(parent), own, Adapted(lin))
    return model


def test_role_name_sees_through_wrappers():
    assert roles.role_name("layers.0.self_attn.k_proj.base_layer") == "layers.0.self_attn.k_proj"
    assert roles.role_name("lm_head.modules_to_save.default") == "lm_head"
    assert roles.role_name("lm_head.original_module") == "lm_head"
    assert roles.role_name("a.base_layer.base_layer") == "a"  # nested wrappers
    assert roles.role_name("layers.0.base_layer_norm") == "layers.0.base_layer_norm"  # a name, not a wrapper
    assert roles.own_name("layers.0.self_attn.v_proj.base_layer") == "v_proj"


def test_adapters_first_keeps_what_convert_first_keeps():
    torch.manual_seed(0)
    plain = fp8_plan(TinyTransformer())
    adapted = adapt(TinyTransformer(), {"q_proj", "k_proj", "v_proj", "lm_head"})
    plan = fp8_plan(adapted)
    assert {roles.role_name(n) for n in plan.convert} == set(plain.convert)
    assert {roles.role_name(n) for n in plan.kept} == set(plain.kept)
    assert "layers.0.k_proj.base_layer" in plan.kept and "lm_head.base_layer" in plan.kept
    assert set(plan.adapters) == roles.adapter_linears(adapted)
    assert len(plan.adapters) == 2 * 7  # lora_A and lora_B of 3 projections in 2 blocks and of the head
    assert not set(plan.adapters) & set(plan.convert)


def test_adapters_stay_high_precision_even_without_keep_rules_or_with_a_filter():
    adapted = adapt(TinyTransformer(), {"q_proj", "v_proj"})
    model = mf.convert(adapted, keep_first_last=False, filter=lambda name, layer: True)
    for name in roles.adapter_linears(model):
        assert type(model.get_submodule(name)) is nn.Linear, name
    assert isinstance(model.layers[0].q_proj.base_layer, mf.Fp8Linear)


def test_adapter_training_moves_only_adapters_and_ends_the_base_steps():
    torch.manual_seed(0)
    model = mf.convert(adapt(TinyTransformer(), {"q_proj", "k_proj", "v_proj"}))
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if ".base_layer." in n}
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    x = torch.randn(4, 8, 64)
    for _ in range(3):
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    base = model.layers[1].q_proj.base_layer
    assert isinstance(base, mf.Fp8Linear)
    history = base.fp8_state.amax_history  # one row per ended step (row 0: the step in progress, none now)
    assert int((history != 0).any(dim=1).sum()) == 3, "the frozen base's FP8 steps did not end"
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    assert model.layers[1].q_proj.lora_B["default"].weight.abs().max() > 0


# ------------------------------------------------------------------------------------------------- PEFT itself

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).eval()


def lora(model, **overrides):
    config = dict(r=RANK, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                           "lm_head"])
    config.update(overrides)
    return peft.get_peft_model(model, peft.LoraConfig(**config))


def base_names(model) -> set[str]:
    """Names of the Fp8Linear layers, as the role each plays in the plain model (PEFT's prefix dropped)."""
    prefix = "base_model.model."
    return {roles.role_name(n).removeprefix(prefix) for n, m in model.named_modules() if isinstance(m, mf.Fp8Linear)}


def test_peft_first_converts_the_layers_convert_first_converts_with_the_same_logits():
    first = lora(mf.convert(tiny_llama()))
    later = mf.convert(lora(tiny_llama()))
    assert base_names(later) == base_names(first)
    assert "model.layers.0.self_attn.k_proj" not in base_names(later)  # kept through its wrapper
    assert "lm_head" not in base_names(later)
    for model in (first, later):
        assert all(type(m) is nn.Linear for n, m in model.named_modules() if ".lora_" in n
                   and isinstance(m, nn.Linear)), "an adapter was converted"
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(first(input_ids=ids).logits, later(input_ids=ids).logits)


def test_peft_modules_to_save_head_stays_high_precision():
    model = mf.convert(lora(tiny_llama(), target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]))
    heads = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and roles.own_name(n) == "lm_head"]
    assert len(heads) == 2  # original_module and modules_to_save.default
    assert not any(isinstance(model.get_submodule(n), mf.Fp8Linear) for n in heads)
    assert isinstance(model.base_model.model.model.layers[1].self_attn.q_proj.base_layer, mf.Fp8Linear)


# ------------------------------------------------------------------------------ adapters over prepared FP8 weights

def prepared_lora(**overrides):
    from minifloat.inference.adapters import lora_config

    prepared = mf.prepare_inference(tiny_llama(), recipe=mf.CurrentScaling())
    config = dict(r=RANK, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    config.update(overrides)
    return peft.get_peft_model(prepared, lora_config(peft.LoraConfig(**config)))


def quantized_buffers(model) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers() if n.endswith(("weight", "weight_scale"))}


def test_lora_trains_over_prepared_fp8_weights_and_leaves_them_untouched():
    from minifloat.inference.layers import Fp8InferenceLinear

    model = prepared_lora()
    wrapped = model.base_model.model.model.layers[1].self_attn.q_proj
    assert isinstance(wrapped.base_layer, Fp8InferenceLinear)
    before = quantized_buffers(model)
    assert before, "no quantized weights found"
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(8):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses  # the adapters learn through the frozen FP8 layers
    after = quantized_buffers(model)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_a_saved_adapter_loads_back_onto_a_prepared_model_bitwise(tmp_path):
    from minifloat.inference.adapters import lora_config

    model = prepared_lora(init_lora_weights=False)  # random B: the adapter changes the logits
    model.save_pretrained(tmp_path)
    again = mf.prepare_inference(tiny_llama(), recipe=mf.CurrentScaling())
    again = peft.PeftModel.from_pretrained(again, tmp_path, config=lora_config(peft.LoraConfig.from_pretrained(tmp_path)))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, again(input_ids=ids).logits)


def test_merging_into_quantized_weights_is_refused_with_one_line():
    from minifloat.inference.adapters import MERGE_REFUSED

    model = prepared_lora()
    with pytest.raises(ValueError, match="cannot be merged") as info:
        model.merge_and_unload()
    assert str(info.value) == MERGE_REFUSED and "\n" not in MERGE_REFUSED


def test_lora_config_names_what_it_takes():
    from minifloat.inference.adapters import lora_config

    with pytest.raises(TypeError, match="peft.LoraConfig"):
        lora_config({"r": 16})


def test_transformers_trainer_with_lora_ends_the_fp8_steps_of_the_frozen_base(tmp_path):
    """docs/fp8.md's claim, under transformers' own Trainer: its optimizer holds only the adapters, and each of its
    steps still ends the FP8 step of the frozen base layers the forwards went through."""
    model = mf.convert(lora(tiny_llama().train(), target_modules=["q_proj", "v_proj"]))
    base = model.base_model.model.model.layers[1].self_attn.q_proj.base_layer
    assert isinstance(base, mf.Fp8Linear) and not base.weight.requires_grad
    adapter = model.base_model.model.model.layers[1].self_attn.q_proj.lora_B["default"].weight
    before = adapter.detach().clone()
    generator = torch.Generator().manual_seed(4)
    data = [{"input_ids": row, "labels": row} for row in torch.randint(0, 128, (8, 16), generator=generator)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
                                          learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True,
                                          logging_strategy="no", disable_tqdm=True)
    transformers.Trainer(model=model, args=args, train_dataset=data).train()
    history = base.fp8_state.amax_history
    assert int((history != 0).any(dim=1).sum()) == 3, "the Trainer's steps did not end the frozen base's FP8 steps"
    assert not torch.equal(adapter.detach(), before)


def test_preparing_after_get_peft_model_is_the_lora_config_order_bitwise():
    """prepare_inference of a model PEFT already wrapped quantizes the base layers only (the adapters stay nn.Linear);
    with the same adapter weights it computes bitwise what lora_config's order (prepare, then get_peft_model) does."""
    from minifloat.inference.adapters import lora_config
    from minifloat.inference.layers import Fp8InferenceLinear

    config = dict(r=RANK, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    after = mf.prepare_inference(peft.get_peft_model(tiny_llama(), peft.LoraConfig(**config)),
                                 recipe=mf.CurrentScaling())
    before = peft.get_peft_model(mf.prepare_inference(tiny_llama(), recipe=mf.CurrentScaling()),
                                 lora_config(peft.LoraConfig(**config)))
    wrapped = after.base_model.model.model.layers[1].self_attn.q_proj
    assert isinstance(wrapped.base_layer, Fp8InferenceLinear) and type(wrapped.lora_A["default"]) is nn.Linear
    adapters = {k: v for k, v in after.state_dict().items() if ".lora_" in k}
    assert adapters and not before.load_state_dict(adapters, strict=False).unexpected_keys
    with torch.no_grad():
        assert torch.equal(after(input_ids=ids_batch()).logits, before(input_ids=ids_batch()).logits)


def ids_batch() -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5))
