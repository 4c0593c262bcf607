"""JSON Schema analysis: checks, the rewrites every backend enforces, coverage, intersections,
property orders and the Lark form of what JSON-schema engines cannot express."""
