"""The job API: the job spec and its checks, the job registry and its Redis records, the gRPC and REST servers and
the API's clients. The rank processes that run the jobs are `ranks/`."""
