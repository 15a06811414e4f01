"""The capacity planner behind `fleetgate bench`: how many users an endpoint serves within SLOs."""
