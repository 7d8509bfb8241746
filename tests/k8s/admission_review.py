"""A ValidatingAdmissionPolicy and its binding, applied offline to an admission request.

No API server can run here, so this follows the documented semantics of
admissionregistration.k8s.io/v1 (kubernetes.io/docs/reference/access-authn-authz/
validating-admission-policy/) for what our policy uses, and evaluates its CEL with cel-python
(module ``celpy``), a CEL interpreter independent of the API server's (cel-go):

- the policy's ``matchConstraints.resourceRules`` select the request (group, version,
  resource, operation);
- the binding's ``paramRef.selector`` takes the parameter objects of the request's namespace
  (no ``paramRef.namespace``); none: ``parameterNotFoundAction``;
- the policy is evaluated once per parameter and the request is denied when any evaluation
  denies (each parameter's results are ANDed);
- per parameter: every ``matchConditions`` expression must be true for the policy to apply;
  ``variables`` are evaluated in order, lazily (an error is an error only where it is used,
  which cel-python's error values give); every ``validations`` expression must be true;
- an expression that fails to evaluate falls under ``failurePolicy`` (ours: Fail, a denial).

One quirk of cel-python is worked around (see ``_evaluate``): a string built with ``+`` comes
back as a plain Python ``str``, whose ``.contains()`` it cannot call.

What is not reproduced: the API server's type-checking of the expressions against the Pod
schema (when the policy is created), its CEL cost limits, the defaulting and mutating
admission that run before validation, and ``authorizer``/``namespaceObject``, which our
policy does not use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import celpy
from celpy.evaluation import CELEvalError

Obj = dict[str, Any]

#: The failed validations' messages of a denied request; [] when admitted.
Denials = list[str]


@dataclass(frozen=True)
class Request:
    """The parts of an AdmissionRequest our policy reads."""

    operation: str  # CREATE, UPDATE, DELETE
    namespace: str
    username: str
    resource: str = "pods"
    group: str = ""
    version: str = "v1"

    def to_cel(self) -> Obj:
        return {
            "operation": self.operation,
            "namespace": self.namespace,
            "userInfo": {"username": self.username},
            "resource": {"group": self.group, "version": self.version, "resource": self.resource},
        }


class PolicyReview:
    """Admission requests reviewed by one policy through one binding."""

    def __init__(self, policy: Obj, binding: Obj) -> None:
        assert binding["spec"]["policyName"] == policy["metadata"]["name"]
        assert binding["spec"]["validationActions"] == ["Deny"]
        self.policy, self.binding = policy["spec"], binding["spec"]
        self._env = celpy.Environment()
        self.match_conditions = [
            self._compile(c["expression"]) for c in self.policy["matchConditions"]
        ]
        self.variables = [
            (v["name"], self._compile(v["expression"])) for v in self.policy.get("variables", [])
        ]
        self.validations = [
            (self._compile(v["expression"]), v["message"]) for v in self.policy["validations"]
        ]

    def _compile(self, expression: str) -> Any:
        return self._env.program(self._env.compile(expression))

    def matches(self, request: Request) -> bool:
        for rule in self.policy["matchConstraints"]["resourceRules"]:
            if (
                request.group in rule["apiGroups"]
                and request.version in rule["apiVersions"]
                and request.resource in rule["resources"]
                and request.operation in rule["operations"]
            ):
                return True
        return False

    def params_for(self, request: Request, candidates: list[Obj]) -> list[Obj]:
        """The parameter objects the binding selects for ``request``."""
        kind = self.policy["paramKind"]
        ref = self.binding["paramRef"]
        assert "namespace" not in ref and "name" not in ref
        wanted = ref["selector"]["matchLabels"]
        return [
            obj
            for obj in candidates
            if obj["apiVersion"] == kind["apiVersion"]
            and obj["kind"] == kind["kind"]
            and obj["metadata"].get("namespace") == request.namespace
            and wanted.items() <= (obj["metadata"].get("labels") or {}).items()
        ]

    def review(
        self,
        request: Request,
        *,
        obj: Obj | None = None,
        old: Obj | None = None,
        candidates: list[Obj],
    ) -> Denials:
        """The messages of the validations that deny ``request``; [] when it is admitted."""
        if not self.matches(request):
            return []
        params = self.params_for(request, candidates)
        if not params:
            action = self.binding["paramRef"]["parameterNotFoundAction"]
            return [] if action == "Allow" else ["no parameters found"]
        denials: Denials = []
        for param in params:
            denials += self._evaluate(request, obj, old, param)
        return denials

    def _evaluate(self, request: Request, obj: Obj | None, old: Obj | None, param: Obj) -> Denials:
        activation: dict[str, Any] = {
            "request": celpy.json_to_cel(request.to_cel()),
            "object": celpy.json_to_cel(obj),
            "oldObject": celpy.json_to_cel(old),
            "params": celpy.json_to_cel(param),
        }
        failure = self.policy["failurePolicy"]
        for condition in self.match_conditions:
            try:
                if not condition.evaluate(activation):
                    return []
            except CELEvalError as exc:
                return [f"match condition failed to evaluate: {exc}"] if failure == "Fail" else []
        values: dict[Any, Any] = {}
        for name, program in self.variables:
            activation["variables"] = celpy.celtypes.MapType(values)
            try:
                value = program.evaluate(activation)
            except CELEvalError as exc:
                value = exc  # an error only where it is used
            if type(value) is str:
                # cel-python 0.5.0 gives a concatenation ('a' + 'b') as a plain str, on which
                # its own `.contains()` then fails ("no such overload"); CEL's result is a string.
                value = celpy.celtypes.StringType(value)
            values[celpy.celtypes.StringType(name)] = value
        activation["variables"] = celpy.celtypes.MapType(values)
        denials = []
        for program, message in self.validations:
            try:
                allowed = program.evaluate(activation)
            except CELEvalError as exc:
                if failure == "Fail":
                    denials.append(f"{message} (failed to evaluate: {exc})")
                continue
            assert isinstance(allowed, celpy.celtypes.BoolType), (message, allowed)
            if not allowed:
                denials.append(message)
        return denials
