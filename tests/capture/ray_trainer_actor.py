"""Run by test_verl_ray.py in its own process: a Ray actor in the role of verl's TaskRunner runs a
legacy trainer's ``fit`` with the capture turned on only through the actor's environment, and is
killed (``ray.kill``) while step 3 is in flight. Usage: python ray_trainer_actor.py RUN MARKER."""

from __future__ import annotations

import os
import sys

import ray

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@ray.remote(num_cpus=1)
class TaskRunner:
    def run(self, marker: str) -> None:
        import verl.trainer.ppo.ray_trainer as rt  # noqa: F401 - patched on import by the capture

        import rldiag.capture.verl as capture
        from tests.capture import test_verl, verl_steps

        # installed from the actor's environment alone, and verl's fit already wrapped on import
        assert capture._SESSION is not None and getattr(rt.RayPPOTrainer.fit, "__rldiag_capture__", False)
        capture.uninstall()  # wrap the test's fit body instead of verl's (which needs workers)
        rt.RayPPOTrainer.fit = verl_steps.legacy_fit(n_steps=4, rows=8, hang_at=3, marker=marker)
        capture.install()  # from $RLDIAG_CAPTURE_DIR again
        test_verl._trainer(rt.RayPPOTrainer, test_verl._config("gae", n=2, kl_in_reward=True, mode="legacy")).fit()


def main(run_dir: str, marker: str) -> None:
    env = {"VERL_USE_EXTERNAL_MODULES": "rldiag.capture.verl", "RLDIAG_CAPTURE_DIR": run_dir,
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    try:
        runner = TaskRunner.remote()
        pending = runner.run.remote(marker)
        while not os.path.exists(marker):  # the actor creates it once step 3 is in flight
            done, _ = ray.wait([pending], timeout=0.2)
            if done:
                ray.get(done[0])  # the actor failed before step 3: raise its error here
                raise SystemExit("the actor returned before step 3")
        ray.kill(runner, no_restart=True)
        print("killed", flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
