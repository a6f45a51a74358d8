# The tester only: it talks HTTP and needs no GPU or vLLM.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY blackbox ./blackbox
COPY servers ./servers
RUN pip install --no-cache-dir .
ENTRYPOINT []
