"""circuit-tracer's side of benchmarks/graph_speed.py, run in the reference environment (see benchmarks/peers.md).

    python benchmarks/graph_speed_reference.py OUT    # OUT written by `graph_speed.py export OUT`

``graph_speed.py run`` starts it. It builds Gemma 3 270M as circuit-tracer's
``TransformerLensReplacementModel`` (TransformerLens 2.18's ``HookedTransformer.from_pretrained(
"google/gemma-3-270m", hf_model=...)`` over the exported folder, offline; no folding or centring,
as circuit-tracer loads models) with the exported transcoders loaded by circuit-tracer's own
``load_transcoder_set`` (a TopK set gets its activation set after loading, as in
benchmarks/peers_reference.py), then answers one command per line on stdin with one JSON line on
stdout, marked ``@@``:

* ``round BATCH``: one ``attribute`` of the prompt (the exported top answer token as the target,
  ``max_feature_nodes=1000``, ``batch_size=BATCH``): its wall and CPU seconds;
* ``save PATH BATCH``: the same graph's adjacency matrix, its expanded features ``(layer,
  position, feature)`` and its count of active features, to PATH (safetensors);
* ``quit``.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
from peers_reference import topk_relu  # noqa: E402  (the same TopK as this package's: ReLU of the k largest)

MAX_FEATURE_NODES = 1000


def replacement_model(out: Path):
    import yaml
    from circuit_tracer.replacement_model.replacement_model_transformerlens import TransformerLensReplacementModel
    from circuit_tracer.transcoder import load_transcoder_set
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    folder = out / "ct_transcoders"
    config = yaml.safe_load((folder / "config.yaml").read_text())
    transcoders = load_transcoder_set({i: str(folder / f) for i, f in enumerate(config["transcoders"])},
                                      scan=config["scan"], feature_input_hook=config["feature_input_hook"],
                                      feature_output_hook=config["feature_output_hook"], device=torch.device("cpu"),
                                      dtype=torch.float32, lazy_encoder=False, lazy_decoder=False)
    assert config["activation_function"] == "topk"
    for t in transcoders:
        t.activation_function = topk_relu(config["k"])
    hf = AutoModelForCausalLM.from_pretrained(str(out / "hf"), dtype=torch.float32, local_files_only=True)
    # TransformerLens 2 re-reads a tokenizer by its name_or_path: the fast tokenizer, saved and read back
    fast = PreTrainedTokenizerFast(tokenizer_file=str(out / "hf" / "tokenizer.json"), bos_token="<bos>",
                                   eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    saved = tempfile.mkdtemp()
    fast.save_pretrained(saved)
    tokenizer = AutoTokenizer.from_pretrained(saved)
    return TransformerLensReplacementModel.from_pretrained_and_transcoders(
        "google/gemma-3-270m", transcoders, hf_model=hf, tokenizer=tokenizer, device="cpu", dtype=torch.float32)


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    import circuit_tracer
    from circuit_tracer import attribute

    model = replacement_model(out)
    exported = load_file(str(out / "prompt.safetensors"))
    tokens, logits = exported["tokens"], exported["logits"]
    target = logits.argmax()[None]
    with torch.inference_mode():
        theirs = model(tokens[None])[0, -1]
    ready = dict(circuit_tracer=circuit_tracer.__version__, torch=torch.__version__, threads=torch.get_num_threads(),
                 logits_gap=float((theirs - logits).abs().max()), target=int(target))
    print("@@ " + json.dumps(ready), flush=True)

    def graph(batch: int):
        return attribute(tokens, model, attribution_targets=target, max_feature_nodes=MAX_FEATURE_NODES,
                         batch_size=batch)

    for line in sys.stdin:
        words = line.split()
        if words[0] == "round":
            wall, cpu = time.perf_counter(), time.process_time()
            graph(int(words[1]))
            answer = dict(seconds=time.perf_counter() - wall, cpu=time.process_time() - cpu)
        elif words[0] == "save":
            g = graph(int(words[2]))
            selected = g.active_features[g.selected_features]  # [n, 3]: layer, position, feature
            save_file({"adjacency": g.adjacency_matrix.float().contiguous(), "selected": selected.contiguous(),
                       "n_active": torch.tensor(len(g.active_features))}, words[1])
            answer = dict(saved=words[1])
        else:
            print("@@ {}", flush=True)
            return
        print("@@ " + json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
