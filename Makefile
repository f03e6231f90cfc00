# The two commands of the README, plus the steps they are made of.
.PHONY: up test test-compose setup tools lint

# Prometheus and Alertmanager are helpers of `up`: without them (no apt, no sudo) it serves anyway.
up: setup
	-@scripts/setup-tools --monitoring
	.venv/bin/appliance up

# The suite, then the compose stack on podman (its images build in the background meanwhile): scripts/test.
test: setup tools
	.venv/bin/ruff check appliance tests bench
	.venv/bin/mypy
	scripts/test

# Both compose tests: the stack, and `make up` on a fresh clone in a clean container.
test-compose: setup tools
	.venv/bin/python -m pytest -m compose tests/compose

setup:
	@scripts/setup

tools:
	@scripts/setup-tools

# Ruff over the code and its tests, then mypy --strict over appliance/ (pyproject.toml's [tool.mypy]).
lint: setup
	.venv/bin/ruff check appliance tests bench
	.venv/bin/mypy
