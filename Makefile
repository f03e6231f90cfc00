# The two commands of the README, plus the steps they are made of.
.PHONY: up test setup tools lint

# Prometheus and Alertmanager are helpers of `up`: without them (no apt, no sudo) it serves anyway.
up: setup
	-@scripts/setup-tools
	.venv/bin/appliance up

test: setup tools
	.venv/bin/ruff check appliance tests bench
	.venv/bin/python -m pytest

setup:
	@scripts/setup

tools:
	@scripts/setup-tools

lint: setup
	.venv/bin/ruff check appliance tests bench
