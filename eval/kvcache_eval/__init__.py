"""kvcache_eval: a small Llama-style decoder trained here on synthetic long-context tasks,
and the evaluation that drives it through a real kvcached (docs/EVALUATION.md).

    eval/kvcache-eval                      # the evaluation (needs torch)
    PYTHONPATH=eval python3 -m kvcache_eval.train --out eval/weights/decoder.pt
"""
