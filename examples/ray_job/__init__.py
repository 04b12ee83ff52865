"""A trainer that runs as a Ray actor, the way slime and verl run theirs.

- `loss.compute_advantages_and_returns(args, rollout_data)`: the function to guard, in
  slime's shape, with the in-place KL shaping bug (`k *= -kl_coef` on the tensors of
  `rollout_data["kl"]`).
- `actor.TrainActor`: a plain class the driver turns into a Ray actor
  (`ray.remote(...)(TrainActor)`, as slime's `RayTrainGroup` does). It may initialise
  `torch.distributed` (gloo), then calls the loss function once per `train_step`.

Nothing here knows about kvguard: the actor process activates it from `KVGUARD*`
variables alone, inherited from the environment that started the Ray cluster or passed in
`runtime_env={"env_vars": ...}` (see the README's "Ray-based trainers" and
`tests/test_ray.py`). The modules import as `ray_job.*` with `examples/` on the path; Ray's
workers get only the driver's script directory and working directory from its `sys.path`,
so the test puts `examples/` on `PYTHONPATH` for the cluster, as slime's runtime env does.
"""
