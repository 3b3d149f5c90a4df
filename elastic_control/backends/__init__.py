"""The backend interface: ``Backend`` and ``Deployment`` (base.py) and the status document (status.py).

The implementations live with everything they run: ``elastic_control/local/`` (processes on this machine)
and ``elastic_control/kube/`` (Kubernetes); ``elastic_control.api`` picks one for a plan.
"""
