"""Drives the real vLLM (run with vLLM's venv python; tests/events/test_vllm_plugin.py):

    python drive.py MODEL_DIR OUT.json

A small KV pool (24 blocks of 32 tokens) and a workload that makes vLLM preempt, hit its
prefix cache, evict, and reset the cache. The kvscope plugin is configured by the
environment the test sets (KVSCOPE_RECORD, VLLM_ENABLE_V1_MULTIPROCESSING); this script
only runs vLLM and writes what it saw (request outputs, vLLM's version) to OUT.json."""

import json
import sys

from vllm import LLM, SamplingParams


def main() -> None:
    model, out = sys.argv[1], sys.argv[2]
    llm = LLM(model=model, block_size=32, num_gpu_blocks_override=24, max_model_len=512,
              enable_prefix_caching=True, max_num_seqs=6, max_num_batched_tokens=512,
              seed=0,
              # the page table does not depend on how the forward runs: no torch.compile
              # (minutes of a 2-core box's time at each start)
              enforce_eager=True)
    system = "You are a helpful assistant who answers in one short sentence. " * 6
    words = "apple river stone cloud garden music paper window light forest".split()
    shared = [f"{system} Question {i}: why is {words[i % 10]} {words[(i * 3) % 10]}?"
              for i in range(8)]
    distinct = [f"Story {i}: " + " ".join(words[(i + k) % 10] + str(k % 7)
                                         for k in range(60)) for i in range(6)]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    texts = [o.outputs[0].text for o in llm.generate(shared + distinct, params)]
    assert llm.reset_prefix_cache(), "vLLM refused to reset its prefix cache"
    texts += [o.outputs[0].text for o in llm.generate(shared[:4], params)]
    import vllm

    with open(out, "w") as f:
        json.dump({"vllm_version": vllm.__version__, "outputs": texts}, f)


if __name__ == "__main__":
    main()
