"""Evaluation harness: RULER-style tasks on real text, fidelity metrics, a resumable runner, reports.

    from kvsieve.eval import tasks
    sample = tasks.make_sample("niah_single_2", tokenizer, length=2048, index=0, seed=0)
    from kvsieve.eval.runner import EvalConfig, run_eval
"""
