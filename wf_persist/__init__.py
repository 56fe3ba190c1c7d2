"""wf_persist: durable Python workflows on an SQLAlchemy persistence layer.

Workflows are plain functions whose durable calls go through a context; their history lives
in ordinary tables (``wf_workflows``, ``wf_executions``, ``wf_history``) made by Alembic
migrations, on SQLite, PostgreSQL or MySQL/MariaDB.
"""

from __future__ import annotations

from . import migrate as migrate
from .async_client import AsyncClient as AsyncClient
from .async_context import AsyncContext as AsyncContext
from .authoring import Call as Call
from .authoring import Step as Step
from .authoring import Workflow as Workflow
from .authoring import call as call
from .authoring import step as step
from .authoring import workflow as workflow
from .backends import create_engine as create_engine
from .children import ChildHandle as ChildHandle
from .client import Client as Client
from .client import Completed as Completed
from .client import ExecutionHandle as ExecutionHandle
from .client import ExecutionInfo as ExecutionInfo
from .client import Failed as Failed
from .client import HistoryRecord as HistoryRecord
from .client import Outcome as Outcome
from .client import Page as Page
from .client import PendingSignal as PendingSignal
from .client import WorkflowEntry as WorkflowEntry
from .context import Context as Context
from .embedded import WorkflowClient as WorkflowClient
from .errors import Cancelled as Cancelled
from .errors import CancelledCallError as CancelledCallError
from .errors import CannotCancelError as CannotCancelError
from .errors import ChildWorkflowError as ChildWorkflowError
from .errors import ClosedError as ClosedError
from .errors import CodeExecutionError as CodeExecutionError
from .errors import DatabaseConnectError as DatabaseConnectError
from .errors import DatabaseUnavailableError as DatabaseUnavailableError
from .errors import DriveFailedError as DriveFailedError
from .errors import EventNotSetError as EventNotSetError
from .errors import ForkedRuntimeError as ForkedRuntimeError
from .errors import IdempotencyConflictError as IdempotencyConflictError
from .errors import InvalidArgumentError as InvalidArgumentError
from .errors import InvalidCursorError as InvalidCursorError
from .errors import InvalidPayloadError as InvalidPayloadError
from .errors import LeaseLostError as LeaseLostError
from .errors import MergedSchemaVersionError as MergedSchemaVersionError
from .errors import MissingWorkflowVersionError as MissingWorkflowVersionError
from .errors import NonDeterminismError as NonDeterminismError
from .errors import NotSerializableError as NotSerializableError
from .errors import PoolExhaustedError as PoolExhaustedError
from .errors import PoolTooSmallError as PoolTooSmallError
from .errors import ResultTimeoutError as ResultTimeoutError
from .errors import SchemaNamesTakenError as SchemaNamesTakenError
from .errors import SchemaTooNewError as SchemaTooNewError
from .errors import SchemaVersionConflictError as SchemaVersionConflictError
from .errors import SchemaVersionError as SchemaVersionError
from .errors import SignalAlreadyDeliveredError as SignalAlreadyDeliveredError
from .errors import SignalDeliveryError as SignalDeliveryError
from .errors import SignalNotWaitingError as SignalNotWaitingError
from .errors import SignalPayloadError as SignalPayloadError
from .errors import StatementCancelledError as StatementCancelledError
from .errors import StepExecutionError as StepExecutionError
from .errors import StepTimeoutError as StepTimeoutError
from .errors import UnknownExecutionError as UnknownExecutionError
from .errors import UnknownWorkflowError as UnknownWorkflowError
from .errors import UnsupportedDatabaseError as UnsupportedDatabaseError
from .errors import ValueTooLargeError as ValueTooLargeError
from .errors import WfPersistError as WfPersistError
from .errors import WorkflowDefinitionError as WorkflowDefinitionError
from .errors import WorkflowFailedError as WorkflowFailedError
from .errors import WorkflowTimeoutError as WorkflowTimeoutError
from .errors import WorkflowVersionConflictError as WorkflowVersionConflictError
from .models import Base as Base
from .models import metadata as metadata
from .policies import Limit as Limit
from .policies import Retry as Retry
from .replay import Received as Received
from .replay import TimedOut as TimedOut
from .runtime import Runtime as Runtime
from .secrets import SecretError as SecretError
from .secrets import SecretResolver as SecretResolver
from .secrets import env_secret_resolver as env_secret_resolver
from .secrets import secret as secret
from .worker import Worker as Worker

__all__ = [
    "AsyncClient",
    "AsyncContext",
    "Base",
    "Call",
    "Cancelled",
    "CancelledCallError",
    "CannotCancelError",
    "ChildHandle",
    "ChildWorkflowError",
    "Client",
    "ClosedError",
    "CodeExecutionError",
    "Completed",
    "Context",
    "DatabaseConnectError",
    "DatabaseUnavailableError",
    "DriveFailedError",
    "EventNotSetError",
    "ExecutionHandle",
    "ExecutionInfo",
    "Failed",
    "ForkedRuntimeError",
    "HistoryRecord",
    "IdempotencyConflictError",
    "InvalidArgumentError",
    "InvalidCursorError",
    "InvalidPayloadError",
    "LeaseLostError",
    "Limit",
    "MergedSchemaVersionError",
    "MissingWorkflowVersionError",
    "NonDeterminismError",
    "NotSerializableError",
    "Outcome",
    "Page",
    "PendingSignal",
    "PoolExhaustedError",
    "PoolTooSmallError",
    "Received",
    "ResultTimeoutError",
    "Retry",
    "Runtime",
    "SchemaNamesTakenError",
    "SchemaTooNewError",
    "SchemaVersionConflictError",
    "SchemaVersionError",
    "SecretError",
    "SecretResolver",
    "SignalAlreadyDeliveredError",
    "SignalDeliveryError",
    "SignalNotWaitingError",
    "SignalPayloadError",
    "StatementCancelledError",
    "Step",
    "StepExecutionError",
    "StepTimeoutError",
    "TimedOut",
    "UnknownExecutionError",
    "UnknownWorkflowError",
    "UnsupportedDatabaseError",
    "ValueTooLargeError",
    "WfPersistError",
    "Worker",
    "Workflow",
    "WorkflowClient",
    "WorkflowDefinitionError",
    "WorkflowEntry",
    "WorkflowFailedError",
    "WorkflowTimeoutError",
    "WorkflowVersionConflictError",
    "call",
    "create_engine",
    "env_secret_resolver",
    "metadata",
    "migrate",
    "secret",
    "step",
    "workflow",
]
