"""`lathe.loop.oom.explain`: the phase that ran out and the keys that lower its memory."""

from lathe.loop.oom import explain


def test_update_advice_names_checkpointing_and_its_layer_count():
    for phase, group in (("update_actor", "actor_rollout_ref.model"), ("update_critic", "critic.model")):
        text = str(explain(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), phase))
        assert f"during {phase}: CUDA out of memory" in text
        assert f"{group}.enable_gradient_checkpointing=true" in text
        assert f"{group}.gradient_checkpointing_layers set: raise it, or null for every layer" in text
