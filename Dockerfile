# One image for the web app and the workers. TPU hosts build with --build-arg EXTRAS=train.
FROM python:3.11-slim
ARG EXTRAS=""
ENV PYTHONUNBUFFERED=1 TUNEDECK_DATA_DIR=/data TUNEDECK_HOST=0.0.0.0
WORKDIR /srv/tunedeck
COPY pyproject.toml README.md alembic.ini ./
COPY app app
COPY worker worker
COPY migrations migrations
COPY templates templates
COPY static static
RUN pip install --no-cache-dir -e ".${EXTRAS:+[$EXTRAS]}"
VOLUME /data
EXPOSE 8000
ENTRYPOINT ["tunedeck"]
CMD ["web"]
