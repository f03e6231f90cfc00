"""Routing as a pipeline: filters (who may take a request), then a policy (weighted scorers, or round robin)."""

from appliance.gateway.routing.pipeline import DECIDERS, Policy, build_policy
from appliance.gateway.routing.request import Decision, RoutingRequest, render_chat, render_completion
from appliance.gateway.routing.view import RoutingView

__all__ = ["DECIDERS", "Decision", "Policy", "RoutingRequest", "RoutingView", "build_policy", "render_chat",
           "render_completion"]
