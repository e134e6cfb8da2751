"""Every test sees 8 virtual CPU devices; the backend starts after this runs."""

import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
sys.path.insert(0, os.path.dirname(__file__))  # tests import the shared `helpers`
