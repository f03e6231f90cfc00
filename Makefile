# The two commands of the README, plus the steps they are made of.
.PHONY: up test setup lint

up: setup
	.venv/bin/appliance up

test: setup
	.venv/bin/ruff check appliance tests bench
	.venv/bin/python -m pytest

setup:
	@scripts/setup

lint: setup
	.venv/bin/ruff check appliance tests bench
