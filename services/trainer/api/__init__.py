"""The job API: the job spec and its checks, the job registry and its Redis records, the gRPC and REST servers, the
rank processes (launch, worker) and the API's clients."""
