# The operator and agent image: `docker build -t tasklease:dev .` (see README, "Run on kind").
FROM python:3.11-slim
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
RUN pip install --no-cache-dir . && rm -rf /src
USER 65532
ENTRYPOINT ["tasklease"]
CMD ["operator"]
