"""On the GPU host, after tools/gpu_host/install.sh: a tiny vLLM 0.33 generate on a config-only Llama.

Run as  PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 python3 tools/gpu_host/smoke.py [DIR]
Writes DIR (default /tmp/models/tiny-llama): a 2-layer Llama config (hidden 256, vocab 32000) and
a small byte-level BPE tokenizer trained here; weights come from load_format="dummy".
"""
import json
import os
import sys
import time


def main():
    d = sys.argv[1] if len(sys.argv) > 1 else "/tmp/models/tiny-llama"
    os.makedirs(d, exist_ok=True)

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    words = "hello world the quick brown fox jumps over a lazy dog system prompt user answer".split()
    tok.train_from_iterator([" ".join(words[i:] + words[:i]) for i in range(len(words))] * 50, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(d)
    json.dump(dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                   hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, vocab_size=32000, max_position_embeddings=2048,
                   rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
                   torch_dtype="bfloat16", tie_word_embeddings=False),
              open(os.path.join(d, "config.json"), "w"))

    import torch
    import vllm
    from vllm import LLM, SamplingParams

    print("torch", torch.__version__, torch.__file__, "vllm", vllm.__version__, flush=True)
    t0 = time.time()
    llm = LLM(model=d, load_format="dummy", max_model_len=512, enforce_eager=True,
              attention_config={"backend": "FLASH_ATTN"}, gpu_memory_utilization=0.3)
    t1 = time.time()
    outs = llm.generate(["hello"] * 4, SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0))
    t2 = time.time()
    for o in outs:
        print(len(o.outputs[0].token_ids), "tokens:", repr(o.outputs[0].text[:60]))
    print(f"SMOKE OK: engine start {t1 - t0:.1f} s, generate {t2 - t1:.2f} s", flush=True)


if __name__ == "__main__":
    main()
    # On the H200 (2026-12-01) the process printed SMOKE OK, then did not exit until killed 130 s
    # later: leave at once; the engine-core process follows its parent.
    sys.stdout.flush()
    os._exit(0)
