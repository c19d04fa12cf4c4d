"""realm_jax."""
