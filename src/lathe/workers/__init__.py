"""The roles verl users know, composed from `train/`, `rollout/` and `reward/` parts, each built from its own
config group: the actor/rollout/reference worker (`actor_rollout_ref`), the critic (`critic`), fully-async
training's rollout replicas and trainer ranks (`fully_async`, with the weight sync of `checkpoint_engine`), and
what each rank of a worker group builds (`build`). The one place that knows how parts share a device and its
memory; `lathe.cluster` places these workers, `lathe.loop` drives them."""
