"""The reference tools on this package's files: run in a separate environment (see benchmarks/peers.md).

    python benchmarks/peers_reference.py OUT    # OUT written by `benchmarks/peers.py export OUT`

Needs circuit-tracer 0.5.0, SAELens 6.54.12 and pyvene 0.1.8 (TransformerLens 2.x, transformers
4.57), never this package: the zoo models are rebuilt as TransformerLens ``HookedTransformer`` s
from their shipped config and safetensors. Prints, as markdown:

* the rebuilt models' logits against this package's (the same model);
* circuit-tracer: our graph JSON validated by its pydantic ``Model``; its graph of each prompt
  (``attribute`` with our transcoders loaded by its ``load_transcoder_set`` from our export, the
  same answer tokens) against ours — node counts, largest edge difference, the JSON it writes
  against ours (same nodes and links); its ``.pt`` written to OUT/reference for `peers.py compare`;
* SAELens: our folders refused as written (no TopK transcoder in SAELens 6), then loaded with a
  ``topk_skip_transcoder`` class registered through its registry; outputs against circuit-tracer's
  transcoders and the MLPs' own outputs (FVU);
* pyvene: our DAS save loaded by ``IntervenableModel.load`` onto zoo:add-3digit, its held-out IIA
  against ours.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINTS = ROOT / "arithinterp" / "models" / "checkpoints"


def hooked_transformer(name: str):
    """A zoo model as a TransformerLens 2.x HookedTransformer (weights mapped from the native layout)."""
    import tempfile

    from transformer_lens import HookedTransformerConfig
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder = CHECKPOINTS / name
    config = json.loads((folder / "config.json").read_text())
    config.pop("seed", None)
    cfg = HookedTransformerConfig(**config, tokenizer_name=str(folder), model_name=name, device="cpu")
    state = sd = load_file(str(folder / "model.safetensors"))
    H, dh, d = cfg.n_heads, cfg.d_head, cfg.d_model
    out = {"embed.W_E": sd["tok_embed.weight"], "pos_embed.W_pos": sd["pos.weight"],
           "ln_final.w": sd["ln_out.weight"], "ln_final.b": sd["ln_out.bias"],
           "unembed.W_U": sd["head.weight"].T, "unembed.b_U": torch.zeros(cfg.d_vocab)}
    for i in range(cfg.n_layers):
        p, b = f"layers.{i}.", f"blocks.{i}."
        for ln in ("ln1", "ln2"):
            out[b + f"{ln}.w"], out[b + f"{ln}.b"] = state[p + f"{ln}.weight"], state[p + f"{ln}.bias"]
        for x in "qkv":
            out[b + f"attn.W_{x.upper()}"] = sd[p + f"attn.{x}.weight"].T.reshape(d, H, dh).permute(1, 0, 2)
            out[b + f"attn.b_{x.upper()}"] = sd[p + f"attn.{x}.bias"].reshape(H, dh)
        out[b + "attn.W_O"] = sd[p + "attn.o.weight"].T.reshape(H, dh, d)
        out[b + "attn.b_O"] = sd[p + "attn.o.bias"]
        out[b + "mlp.W_in"], out[b + "mlp.b_in"] = sd[p + "mlp.fc_in.weight"].T, sd[p + "mlp.fc_in.bias"]
        out[b + "mlp.W_out"], out[b + "mlp.b_out"] = sd[p + "mlp.fc_out.weight"].T, sd[p + "mlp.fc_out.bias"]
    # the shipped tokenizer_config names transformers 5's class: build the fast tokenizer from its fields
    fields = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"),
                                        **{k: fields[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token")})
    saved = tempfile.mkdtemp()  # saved and read back: TransformerLens re-reads it by name_or_path
    tokenizer.save_pretrained(saved)
    cfg.tokenizer_name = saved
    return cfg, out, AutoTokenizer.from_pretrained(saved)


def topk_relu(k: int):
    from circuit_tracer.transcoder.activation_functions import TopK

    top = TopK(k)
    return lambda x: F.relu(top(x))  # this package's "topk": ReLU of the k largest


def circuit_tracer_part(out: Path) -> tuple:
    import yaml
    from circuit_tracer import attribute
    from circuit_tracer.frontend.graph_models import Model
    from circuit_tracer.graph import compute_graph_scores
    from circuit_tracer.replacement_model.replacement_model_transformerlens import TransformerLensReplacementModel
    from circuit_tracer.transcoder import load_transcoder_set
    from circuit_tracer.utils.create_graph_files import create_graph_files

    cfg, state, tokenizer = hooked_transformer("add-100")
    folder = out / "ct_transcoders"
    config = yaml.safe_load((folder / "config.yaml").read_text())
    transcoders = load_transcoder_set({i: str(folder / f) for i, f in enumerate(config["transcoders"])},
                                      scan=config["scan"], feature_input_hook=config["feature_input_hook"],
                                      feature_output_hook=config["feature_output_hook"], device=torch.device("cpu"),
                                      dtype=torch.float32, lazy_encoder=False, lazy_decoder=False)
    assert config["activation_function"] == "topk"
    for t in transcoders:
        t.activation_function = topk_relu(config["k"])
    model = TransformerLensReplacementModel(cfg, tokenizer=tokenizer)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert unexpected == [] and all(k.endswith((".mask", ".IGNORE")) for k in missing), (missing, unexpected)
    model._configure_replacement_model(transcoders)
    ours = load_file(str(out / "logits.safetensors"))
    with torch.inference_mode():
        theirs = model(ours["tokens"])
    gap = float((theirs - ours["logits"]).abs().max())
    print(f"zoo:add-100 as a HookedTransformer: logits max abs difference {gap:.3g}\n")
    summary = json.loads((out / "ours.json").read_text())
    (out / "reference").mkdir(exist_ok=True)
    print("| prompt | our JSON valid in circuit-tracer's Model | nodes ours / theirs | max abs edge difference "
          "| circuit-tracer JSON: same nodes, same links | max link weight difference "
          "| completeness (circuit-tracer / ours all_nodes) | replacement (circuit-tracer / ours) |")
    print("|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for entry in summary["graphs"]:
        name = entry["file"]
        text = (out / "ours" / f"{name}.json").read_text()
        valid = Model.model_validate_json(text) is not None
        exported = load_file(str(out / "ours" / f"{name}.safetensors"))
        graph = attribute(exported["tokens"], model, attribution_targets=exported["logit_tokens"], batch_size=256)
        theirs_edges = graph.adjacency_matrix.float()
        same_shape = theirs_edges.shape == exported["edges"].shape
        diff = float((theirs_edges - exported["edges"]).abs().max()) if same_shape else float("nan")
        worst = max(worst, diff)
        graph.to_pt(str(out / "reference" / f"{name}.pt"))
        create_graph_files(graph, slug=name, output_path=str(out / "reference"), scan=config["scan"])
        ref = json.loads((out / "reference" / f"{name}.json").read_text())
        mine = json.loads(text)
        same_nodes = {n["node_id"] for n in ref["nodes"]} == {n["node_id"] for n in mine["nodes"]}
        ref_links = {(link["source"], link["target"]): link["weight"] for link in ref["links"]}
        my_links = {(link["source"], link["target"]): link["weight"] for link in mine["links"]}
        same_links = set(ref_links) == set(my_links)
        link_diff = max((abs(ref_links[key] - my_links[key]) for key in ref_links.keys() & my_links.keys()),
                        default=0.0)
        replacement, completeness = compute_graph_scores(graph)
        print(f"| {entry['prompt']} | {valid} | {exported['edges'].shape[0]} / {theirs_edges.shape[0]} | {diff:.3g} "
              f"| {same_nodes}, {same_links} ({len(ref['nodes'])} nodes, {len(ref['links'])} links) | {link_diff:.3g} "
              f"| {completeness:.6f} / {entry['scores']['completeness_all_nodes']:.6f} "
              f"| {replacement:.6f} / {entry['scores']['replacement']:.6f} |")
    print(f"\nlargest edge difference over the graphs: {worst:.3g}\n")
    return model, transcoders


def saelens_part(out: Path, model, transcoders) -> None:
    from sae_lens import SAE
    from sae_lens.registry import register_sae_class
    from sae_lens.saes.topk_sae import TopK
    from sae_lens.saes.transcoder import SkipTranscoder, SkipTranscoderConfig
    from sae_lens.util import filter_valid_dataclass_fields

    folders = sorted((out / "saelens").glob("layer_*"))
    try:
        SAE.load_from_disk(str(folders[0]))
        refused = "loaded (unexpected)"
    except Exception as error:  # SAELens raises KeyError for an unregistered architecture
        refused = f"refused: {type(error).__name__} {error}"
    print(f"SAELens 6.54.12 on our TopK skip-transcoder folder as written: {refused}\n")

    @dataclass
    class TopKSkipTranscoderConfig(SkipTranscoderConfig):
        k: int = 100

        @classmethod
        def architecture(cls) -> str:
            return "topk_skip_transcoder"

        @classmethod
        def from_dict(cls, config_dict):
            return cls(**filter_valid_dataclass_fields(config_dict, cls))

    class TopKSkipTranscoder(SkipTranscoder):
        def get_activation_fn(self):
            return TopK(self.cfg.k)  # type: ignore[attr-defined]

        @classmethod
        def from_dict(cls, config_dict):
            return cls(TopKSkipTranscoderConfig.from_dict(config_dict))

    register_sae_class("topk_skip_transcoder", TopKSkipTranscoder, TopKSkipTranscoderConfig)
    prompts = load_file(str(out / "logits.safetensors"))["tokens"]  # the graphs' prompts
    _, cache = model.run_with_cache(prompts)
    print("| layer | SAELens output vs circuit-tracer transcoder (max abs) | FVU against the MLP output (SAELens) |")
    print("|---|---|---|")
    for folder in folders:
        layer = int(folder.name.split("_")[1])
        sae = SAE.load_from_disk(str(folder))
        x = cache[f"blocks.{layer}.mlp.hook_in"].reshape(-1, model.cfg.d_model)
        y = cache[f"blocks.{layer}.hook_mlp_out"].reshape(-1, model.cfg.d_model)
        with torch.no_grad():
            mine = sae(x)
            ref = transcoders[layer](x)
        fvu = float(((y - mine) ** 2).sum() / ((y - y.mean(0)) ** 2).sum())
        print(f"| {layer} | {float((mine - ref).abs().max()):.3g} | {fvu:.4f} |")
    print()


def pyvene_part(out: Path) -> None:
    import pyvene as pv
    from transformer_lens import HookedTransformer

    cfg, state, tokenizer = hooked_transformer("add-3digit")
    model = HookedTransformer(cfg, tokenizer=tokenizer)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert unexpected == [] and all(k.endswith((".mask", ".IGNORE")) for k in missing), (missing, unexpected)
    model.eval()
    model.config = model.cfg  # pyvene reads widths from model.config and the device from model.device
    model.device = torch.device("cpu")
    # pyvene's way to support a model family it does not know: map its components to modules
    pv.type_to_module_mapping[type(model)] = {
        "block_input": ("blocks[%s].hook_resid_pre", pv.models.constants.CONST_OUTPUT_HOOK),
        "block_output": ("blocks[%s].hook_resid_post", pv.models.constants.CONST_OUTPUT_HOOK),
        "mlp_activation": ("blocks[%s].mlp.hook_post", pv.models.constants.CONST_OUTPUT_HOOK),
        "mlp_output": ("blocks[%s].hook_mlp_out", pv.models.constants.CONST_OUTPUT_HOOK),
    }
    pv.type_to_dimension_mapping[type(model)] = {
        "block_input": ("d_model",), "block_output": ("d_model",), "mlp_activation": ("d_mlp",),
        "mlp_output": ("d_model",),
    }
    intervenable = pv.IntervenableModel.load(str(out / "das"), model)
    intervenable.disable_model_gradients()
    summary = json.loads((out / "ours.json").read_text())["das"]
    pairs = load_file(str(out / "das_pairs.safetensors"))
    first, K = summary["first_answer"], pairs["target"].shape[1]
    position = pairs["position"]  # [N, P]: the same positions in base and source
    n_interventions = len(intervenable.interventions)
    correct = []
    for start in range(0, len(position), 128):
        sl = slice(start, start + 128)
        locations = [[[int(p)] for p in position[sl, i]] for i in range(n_interventions)]
        with torch.no_grad():
            _, logits = intervenable({"input": pairs["base"][sl]},
                                     [{"input": pairs["source"][sl]}] * n_interventions,
                                     unit_locations={"sources->base": (locations, locations)})
        predicted = logits[:, first : first + K].argmax(-1)
        correct.append((predicted == pairs["target"][sl]).all(-1))
    iia = float(torch.cat(correct).float().mean())
    print("| DAS fit | pairs | IIA here | IIA in pyvene 0.1.8 |")
    print("|---|---|---|---|")
    print(f"| {summary['model']} {summary['variable']} at {summary['site']} L{summary['layer']} "
          f"{summary['position']}, k={summary['k']} per position | {len(position)} | {summary['iia']:.4f} "
          f"| {iia:.4f} |")


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    import circuit_tracer
    import pyvene
    import sae_lens

    print(f"circuit-tracer {circuit_tracer.__version__}, SAELens {sae_lens.__version__}, "
          f"pyvene {getattr(pyvene, '__version__', '0.1.8')}, torch {torch.__version__}\n")
    model, transcoders = circuit_tracer_part(out)
    saelens_part(out, model, transcoders)
    pyvene_part(out)


if __name__ == "__main__":
    main()
