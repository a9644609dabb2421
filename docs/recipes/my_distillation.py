"""Knowledge distillation: the student's loss gains a term that pulls its predictions towards a
frozen teacher's, a trained run's model loaded with the project's API. The config sets
`teacher` (that run's workdir), `distill_weight` and `temperature`."""

import functools

import jax
import optax

from fmnist_flax import load_model, task
from fmnist_flax.runtime.errors import UserError


@functools.cache
def teacher(workdir: str):
    """The teacher's model, loaded once and outside the step being traced (JAX would stage its
    loading into the step): its parameters enter the compiled step as constants, untrained."""
    if not workdir:
        raise UserError("--config.teacher=WORKDIR: the trained run to distil from is not set")
    with jax.ensure_compile_time_eval():
        return load_model(workdir)


@task.loss_term("distill")
def distill(logits, labels, config, *, images):
    """distill_weight x T^2 x KL(teacher || student) of the predictions at temperature T."""
    t = config.temperature
    taught = jax.nn.softmax(jax.lax.stop_gradient(teacher(config.teacher)(images)) / t)
    return (
        config.distill_weight * t**2 * optax.kl_divergence(jax.nn.log_softmax(logits / t), taught)
    )
