"""CPU stand-in for ``sglang.Engine`` (test of scripts/gpu_check.py only): the methods milehpc calls, with SGLang's
keyword arguments and output shapes, generating with milehpc's reference engine on the config in ``model_path``."""

from __future__ import annotations

from pathlib import Path

__version__ = "standin"


class Engine:
    def __init__(self, *, model_path: str, load_format: str = "auto", random_seed: int = 0, **server_args) -> None:
        import transformers as tf

        from milehpc.data.tokenizer import build_tokenizer
        from milehpc.rollout.reference import ReferenceEngine

        config = tf.AutoConfig.from_pretrained(Path(model_path))
        model = tf.AutoModelForCausalLM.from_config(config).to(getattr(__import__("torch"), server_args.get(
            "dtype", "float32")))
        self.ref = ReferenceEngine(model, build_tokenizer("toy"), seed=random_seed)
        self.server_args = server_args
        self.released: set[str] = set()

    def generate(self, input_ids=None, sampling_params=None, return_logprob=False, return_routed_experts=False,
                 **_):
        from milehpc.rollout.engine import SamplingParams

        assert return_logprob and not (self.released & {"weights", "kv_cache"})
        outs = []
        for ids, sp in zip(input_ids, sampling_params, strict=True):
            params = SamplingParams(temperature=sp["temperature"], top_p=sp["top_p"], top_k=max(sp["top_k"], 0),
                                    max_new_tokens=sp["max_new_tokens"], stop_token_ids=sp.get("stop_token_ids", []))
            new, lps, stopped = self.ref._decode([ids], params)
            finish = {"type": "stop", "matched": new[0][-1]} if stopped[0] else {"type": "length",
                                                                                  "length": len(new[0])}
            outs.append({"output_ids": new[0], "meta_info": {
                "finish_reason": finish, "output_token_logprobs": [(lp, t, None) for lp, t in zip(lps[0], new[0],
                                                                                                  strict=True)]}})
        return outs

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.ref.update_weights(named_tensors, self.ref.version)
        return True, "Succeeded"

    def get_weights_by_name(self, name, truncate_size=100):
        return self.ref.model.state_dict()[name].flatten()[:truncate_size].float().tolist()

    def release_memory_occupation(self, tags=None):
        self.released |= set(tags or ["weights", "kv_cache", "cuda_graph"])

    def resume_memory_occupation(self, tags=None):
        self.released -= set(tags or ["weights", "kv_cache", "cuda_graph"])

    def flush_cache(self):
        return True

    def shutdown(self):
        self.ref = None
