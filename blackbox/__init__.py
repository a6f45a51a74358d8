"""blackbox: a black-box HTTP tester for silent output corruption in vLLM prefix caching x speculative decoding.

One engine (`blackbox.engine`) behind the CLI (`blackbox.cli`) and the pytest plugin (`blackbox.pytest_plugin`).
"""

__version__ = "0.1.0"
