"""kvcache_eval: a small Llama-style decoder trained here on synthetic long-context tasks,
and the evaluation that drives it through a real kvcached (docs/EVALUATION.md).

    clients/eval/kvcache-eval                      # the evaluation (needs torch)
    PYTHONPATH=clients/eval python3 -m kvcache_eval.train --out clients/eval/weights/decoder.pt
"""
