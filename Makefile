# The two commands of the README, plus the steps they are made of.
.PHONY: up test test-compose setup tools lint

# Prometheus and Alertmanager are helpers of `up`: without them (no apt, no sudo) it serves anyway.
up: setup
	-@scripts/setup-tools --monitoring
	.venv/bin/appliance up

# The compose test (tests/compose/) builds images: minutes warm, 20+ cold. It has its own target.
test: setup tools
	.venv/bin/ruff check appliance tests bench
	.venv/bin/python -m pytest -m "not compose"

test-compose: setup tools
	.venv/bin/python -m pytest -m compose tests/compose

setup:
	@scripts/setup

tools:
	@scripts/setup-tools

lint: setup
	.venv/bin/ruff check appliance tests bench
