"""Peer benchmark run in its own virtualenv: Hugging Face transformers `generate` and TRL's
GRPOTrainer on torch CPU (docs/benchmarks_perf.md).

Started by experiments/bench_sampler.py and experiments/bench_train.py as

    <venv>/bin/python experiments/peers/torch_peer.py '<json spec>'

and prints one JSON line (the results) last on stdout. Never imported by Arbor.

What B1 times here (`bench_generate`): token tensors in, token tensors out, the same work as
Arbor's side (a compiled `generate` on a [B, P] token array, returning [B, P + N] tokens).
Each timed call is one `model.generate(input_ids=[B, P] int64 tensor, attention_mask)`
under `torch.inference_mode()`, returning the [B, P + N] tensor; the prompt tensor is built
before the timer and no tokenizer exists on this path (nothing is tokenised or
detokenised). Every row decodes exactly N tokens (`min_new_tokens = max_new_tokens`);
T = 1 is plain softmax(logits / T) sampling (`top_k=0, top_p=1` add no top-k / top-p
warper), T = 0 greedy. The TRL GRPO trainer (`bench_grpo`, B2) takes prompt strings: that
is its interface.

Weights: with spec key "weights" (a Hugging Face folder written by Arbor,
`experiments.peers.export_weights`: B8) both benchmarks load that model with
`AutoModelForCausalLM.from_pretrained` in float32, eval mode, instead of the random Qwen2 of
the B1 shape; the GRPO step then takes the folder's tokenizer and the real text prompts the
spec lists ("grpo": "prompt_texts", with Arbor's token ids of each as "prompt_ids", checked
here), rewarded by the share of digits in the completion text (`digit_share`, Arbor's rule
in experiments/bench_train.py). Spec key "parity_tokens" ([rows][T] ids) returns the model's
logits there (top 8 per position) so that Arbor can check both sides compute the same model.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch
import transformers

import peer_memory  # this folder (see peer_memory's docstring)


def qwen2_model(shape: dict, dtype: torch.dtype = torch.float32,
                device: str = "cpu") -> transformers.Qwen2ForCausalLM:
  """A random-init Qwen2 with the benchmark shape, in eval mode, built directly in `dtype`
  on `device` (an accelerator initialises a billion parameters in a moment; the host
  would take minutes)."""
  config = transformers.Qwen2Config(
      vocab_size=shape["vocab_size"], hidden_size=shape["d_model"],
      intermediate_size=shape["mlp_dim"], num_hidden_layers=shape["n_layers"],
      num_attention_heads=shape["n_heads"], num_key_value_heads=shape["n_kv_heads"],
      head_dim=shape["head_dim"], max_position_embeddings=shape["max_seq_len"],
      rms_norm_eps=shape["norm_eps"], tie_word_embeddings=shape.get("tie_embeddings", False),
      rope_parameters={"rope_type": "default", "rope_theta": shape["rope_theta"]},
      pad_token_id=0, bos_token_id=1, eos_token_id=2)
  torch.manual_seed(0)
  with torch.device(device):
    model = transformers.Qwen2ForCausalLM(config).to(dtype)
  return model.eval()


def load_model(spec: dict) -> transformers.PreTrainedModel:
  """The spec's weights folder (f32, eval mode) when it names one, else the random Qwen2."""
  if not spec.get("weights"):
    return qwen2_model(spec["shape"])
  model = transformers.AutoModelForCausalLM.from_pretrained(spec["weights"], dtype=torch.float32)
  return model.float().eval()


def parity(model, token_rows: list[list[int]], top: int = 8) -> list[dict]:
  """The model's logits at every position of each row: the `top` largest per position."""
  with torch.inference_mode():
    logits = model(input_ids=torch.tensor(token_rows, dtype=torch.int64)).logits.float()
  values, ids = torch.topk(logits, top, dim=-1)
  return [dict(ids=i.tolist(), values=v.tolist()) for i, v in zip(ids, values)]


def bench_generate(spec: dict, model=None) -> list[dict]:
  """B1's transformers side: for each case, the best of `repeats` timed `generate` calls on
  token tensors (see the module docstring) after one untimed warm-up call."""
  model = load_model(spec) if model is None else model
  vocab_size = model.config.vocab_size
  pad_id, eos_id = spec.get("pad_id", 0), spec.get("eos_id", 2)
  rows = []
  for case in spec["cases"]:
    batch, prompt_len, new_tokens, temperature = (case["batch"], case["prompt_len"],
                                                  case["new_tokens"], case["temperature"])
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, vocab_size, (batch, prompt_len), generator=gen)
    mask = torch.ones_like(prompts)
    # min_new_tokens = max_new_tokens: exactly N tokens per row; top_k=0 and top_p=1 turn
    # off the generation-config defaults (top_k=50) so sampling is plain softmax(logits / T).
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad_id,
                  eos_token_id=eos_id)
    kwargs.update(dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
                  if temperature else dict(do_sample=False))

    def run():
      with torch.inference_mode():
        out = model.generate(input_ids=prompts, attention_mask=mask, **kwargs)
      assert out.shape == (batch, prompt_len + new_tokens), out.shape
      return out

    start = time.perf_counter()
    run()
    first = time.perf_counter() - start
    times = []
    for _ in range(spec["repeats"]):
      start = time.perf_counter()
      run()
      times.append(time.perf_counter() - start)
    best = min(times)
    rows.append(dict(case, tokens_per_s=batch * new_tokens / best, best_s=best,
                     compile_s=max(first - best, 0.0)))
    print(f"transformers {case}: {batch * new_tokens / best:.0f} tok/s", file=sys.stderr, flush=True)
  return rows


def word_tokenizer(folder: str, vocab_size: int):
  """An offline WordLevel tokenizer over ids 't0'..'t{V-1}' (0 pad, 1 bos, 2 eos)."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  vocab = {f"t{i}": i for i in range(vocab_size)}
  vocab.update({"<pad>": 0, "<bos>": 1, "<eos>": 2})
  del vocab["t0"], vocab["t1"], vocab["t2"]
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok.decoder = tokenizers.decoders.WordPiece(prefix="##")
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                              bos_token="<bos>", eos_token="<eos>")
  fast.padding_side = "left"
  fast.save_pretrained(folder)
  return transformers.PreTrainedTokenizerFast.from_pretrained(folder)


def digit_share(text: str) -> float:
  """The share of a completion's characters that are digits (0 for an empty one): the B8
  reward, computed as experiments/bench_train.py's `digit_share` computes it for Arbor."""
  return sum(ch.isdigit() for ch in text) / len(text) if text else 0.0


def bench_grpo(spec: dict) -> dict:
  """TRL GRPOTrainer steps: P prompts x G completions x N tokens, f32, no KL, no checkpointing."""
  import datasets  # pylint: disable=import-outside-toplevel
  import trl  # pylint: disable=import-outside-toplevel
  g = spec["grpo"]
  shape = spec["shape"]
  steps = g["repeats"] + 1
  out = {}
  if spec.get("weights"):  # B8: Arbor's exported weights and tokenizer, real text prompts
    folder = spec["weights"]
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    tokenizer.padding_side = "left"
    prompts = g["prompt_texts"]
    assert len(prompts) >= g["prompts"] * steps, (len(prompts), g["prompts"] * steps)
    # TRL tokenises a plain-text prompt with the tokenizer's own call: the same ids as Arbor?
    ids = tokenizer(text=prompts)["input_ids"]
    out["prompt_ids_equal"] = sum(a == b for a, b in zip(ids, g["prompt_ids"]))
    out["prompt_lens"] = sorted({len(i) for i in ids})

    def reward(completions, **kwargs):
      del kwargs
      return [digit_share(c) for c in completions]
  else:
    folder = tempfile.mkdtemp(prefix="arbor_trl_")
    model = qwen2_model(shape)
    model.save_pretrained(folder)
    tokenizer = word_tokenizer(folder, shape["vocab_size"])
    gen = torch.Generator().manual_seed(1)
    prompts = [" ".join(f"t{int(i)}" for i in torch.randint(3, shape["vocab_size"],
                                                            (g["prompt_len"],), generator=gen))
               for _ in range(g["prompts"] * steps)]

    def reward(completions, **kwargs):
      del kwargs  # reward: fraction of even token ids, the same rule as Arbor's step
      return [float(sum(int(w[1:]) % 2 == 0 for w in c.split() if w[1:].isdigit()))
              / max(len(c.split()), 1) for c in completions]
  dataset = datasets.Dataset.from_dict({"prompt": prompts})

  rows = g["prompts"] * g["group_size"]
  args = trl.GRPOConfig(
      output_dir=os.path.join(folder, "out"), per_device_train_batch_size=rows,
      num_generations=g["group_size"], max_completion_length=g["new_tokens"],
      generation_kwargs={"min_new_tokens": g["new_tokens"]}, temperature=1.0, top_k=0, top_p=1.0,
      beta=0.0, num_iterations=1, learning_rate=1e-5, max_steps=steps, bf16=False, fp16=False,
      gradient_checkpointing=False, use_cpu=True, report_to="none", logging_steps=1,
      save_strategy="no", shuffle_dataset=False, seed=0, dataloader_num_workers=0,
      model_init_kwargs={"dtype": "float32"})
  trainer = trl.GRPOTrainer(model=folder, reward_funcs=reward, args=args, train_dataset=dataset,
                            processing_class=tokenizer)
  times, generate_times = [], []
  # The sampling part of each step: TRL calls the model's `generate` (once per step here).
  record_generate_times(trainer.model, generate_times)

  class Timer(transformers.TrainerCallback):
    def on_step_begin(self, *a, **k):
      self.start = time.perf_counter()
      self.generated = len(generate_times)

    def on_step_end(self, *a, **k):
      times.append(time.perf_counter() - self.start)
      sampled.append(sum(generate_times[self.generated:]))

  sampled = []
  trainer.add_callback(Timer())
  trainer.train()
  best = min(range(1, len(times)), key=times.__getitem__)
  # step_s / generate_s: the timed steps after the first (which warms up), as Arbor's.
  return dict(out, first_step_s=times[0], best_step_s=times[best], steps=len(times),
              step_s=times[1:], best_generate_s=sampled[best], generate_s=sampled[1:],
              model_dtype=str(next(trainer.model.parameters()).dtype),
              gradient_checkpointing=bool(getattr(trainer.model, "is_gradient_checkpointing",
                                                  False)))


def record_generate_times(model, seconds: list) -> None:
  """Wraps `model.generate` so that each call appends its wall seconds to `seconds` (the
  sampling part of a TRL step)."""
  inner = model.generate

  def timed_generate(*a, **k):
    start = time.perf_counter()
    result = inner(*a, **k)
    seconds.append(time.perf_counter() - start)
    return result

  model.generate = timed_generate


def trl_main(run) -> None:
  """The entry point of a TRL peer script: `run(spec)` on the JSON spec in argv[1], with the
  spec's thread count, printed as one JSON line with the library versions."""
  spec = json.loads(sys.argv[1])
  torch.set_num_threads(spec.get("threads", os.cpu_count()))
  import trl  # pylint: disable=import-outside-toplevel
  result = {"torch": torch.__version__, "transformers": transformers.__version__,
            "trl": trl.__version__}
  result.update(run(spec))
  print(json.dumps(result), flush=True)


def main():
  spec = json.loads(sys.argv[1])
  torch.set_num_threads(spec.get("threads", os.cpu_count()))
  result = {"torch": torch.__version__, "transformers": transformers.__version__}
  model = None
  if spec.get("parity_tokens"):
    model = load_model(spec)
    result["parity"] = parity(model, spec["parity_tokens"])
  if spec.get("cases"):
    result["generate"] = bench_generate(spec, model)
  del model
  if spec.get("grpo"):
    import trl  # pylint: disable=import-outside-toplevel
    result["trl"] = trl.__version__
    result["grpo"] = bench_grpo(spec)
  result["max_rss_bytes"] = peer_memory.peak_rss_bytes()
  print(json.dumps(result), flush=True)


if __name__ == "__main__":
  main()
