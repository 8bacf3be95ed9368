#!/usr/bin/env bash
# Sets up the scheduled data refresh:
#   1. a Cloud Build trigger that runs dataflow/refresh.cloudbuild.yaml (plan; launch the conversion
#      Flex Template only if shards are new or changed), and
#   2. a Cloud Scheduler job that runs that trigger on a cron schedule.
#
#   PROJECT=my-project BUCKET=my-bucket INPUT='gs://my-bucket/raw/train-*.tfrecord' \
#   OUTPUT=gs://my-bucket/arrayrecord/train REPO=https://github.com/my-org/my-repo \
#   SERVICE_ACCOUNT=refresh@my-project.iam.gserviceaccount.com bash dataflow/schedule_refresh.sh
#
# Optional: REGION (us-central1), SCHEDULE ('0 3 * * *'), TIME_ZONE (Etc/UTC), NAME (arrayrecord-refresh),
# BRANCH (main), PRUNE (false), MAX_WORKERS (10), MACHINE_TYPE (n2-standard-4),
# REPOSITORY (dataflow: the Artifact Registry repository cloudbuild.yaml pushed the image to, its _REPOSITORY),
# PIN (a commit SHA that cloudbuild.yaml built: every refresh then runs that image and template spec, not `latest`).
# DRY_RUN=1 prints the gcloud commands instead of running them.
# Roles and the first run: dataflow/README.md, "Scheduled refreshes".
set -euo pipefail

missing=()
for var in PROJECT BUCKET INPUT OUTPUT REPO SERVICE_ACCOUNT; do
  if [ -z "${!var:-}" ]; then missing+=("$var"); fi
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "error: set ${missing[*]} (see the top of $0 for an example)" >&2
  exit 2
fi
case "$INPUT$OUTPUT" in
  gs://*gs://*) ;;
  *) echo "error: INPUT ($INPUT) and OUTPUT ($OUTPUT) must be gs:// paths: Dataflow workers see Cloud Storage only" >&2; exit 2 ;;
esac

REGION=${REGION:-us-central1}
SCHEDULE=${SCHEDULE:-0 3 * * *}
TIME_ZONE=${TIME_ZONE:-Etc/UTC}
NAME=${NAME:-arrayrecord-refresh}
BRANCH=${BRANCH:-main}

run() {
  if [ -n "${DRY_RUN:-}" ]; then
    printf '%q ' "$@"
    echo
  else
    "$@"
  fi
}

# The template's prune parameter takes true or false alone (the plan step takes more spellings: a refresh would plan,
# then fail at launch on the first night with new shards).
case "${PRUNE:-false}" in
  true|True|TRUE|yes|1|on) PRUNE=true ;;
  false|False|FALSE|no|0|off) PRUNE=false ;;
  *) echo "error: PRUNE=$PRUNE is not true or false" >&2; exit 2 ;;
esac

# '^~^' makes '~' the separator, so that globs and paths may hold commas.
substitutions="^~^_PROJECT=${PROJECT}~_REGION=${REGION}~_BUCKET=${BUCKET}~_INPUT=${INPUT}~_OUTPUT=${OUTPUT}~_PRUNE=${PRUNE}"
substitutions+="~_MAX_WORKERS=${MAX_WORKERS:-10}~_MACHINE_TYPE=${MACHINE_TYPE:-n2-standard-4}~_SERVICE_ACCOUNT=${SERVICE_ACCOUNT}"
substitutions+="~_REPOSITORY=${REPOSITORY:-dataflow}"
if [ -n "${PIN:-}" ]; then
  case "$PIN" in
    *[!0-9a-f]*) echo "error: PIN=$PIN is not a commit SHA (hex digits, as cloudbuild.yaml tags the image)" >&2; exit 2 ;;
  esac
  if [ ${#PIN} -ne 40 ]; then  # cloudbuild.yaml tags the image and names the spec by the full SHA
    echo "error: PIN=$PIN has ${#PIN} hex digits; pass the full commit SHA (git rev-parse $PIN), as cloudbuild.yaml tags the image" >&2
    exit 2
  fi
  substitutions+="~_IMAGE=\${_REGION}-docker.pkg.dev/\${_PROJECT}/\${_REPOSITORY}/\${_IMAGE_NAME}:${PIN}"
  substitutions+="~_TEMPLATE=gs://\${_BUCKET}/templates/tfrecord-to-arrayrecord-${PIN}.json"
fi

run gcloud builds triggers create manual \
  --project="$PROJECT" --region="$REGION" --name="$NAME" \
  --repo="$REPO" --repo-type=GITHUB --branch="$BRANCH" \
  --build-config=dataflow/refresh.cloudbuild.yaml \
  --service-account="projects/${PROJECT}/serviceAccounts/${SERVICE_ACCOUNT}" \
  --substitutions="$substitutions"

if [ -n "${DRY_RUN:-}" ]; then
  trigger_id=TRIGGER_ID
else
  trigger_id=$(gcloud builds triggers describe "$NAME" --project="$PROJECT" --region="$REGION" --format='value(id)')
fi

run gcloud scheduler jobs create http "$NAME" \
  --project="$PROJECT" --location="$REGION" \
  --schedule="$SCHEDULE" --time-zone="$TIME_ZONE" \
  --uri="https://cloudbuild.googleapis.com/v1/projects/${PROJECT}/locations/${REGION}/triggers/${trigger_id}:run" \
  --http-method=POST \
  --headers=Content-Type=application/json \
  --message-body="{\"source\": {\"branchName\": \"${BRANCH}\"}}" \
  --oauth-service-account-email="$SERVICE_ACCOUNT"

if [ -n "${DRY_RUN:-}" ]; then
  echo "DRY_RUN: nothing was created; without DRY_RUN, '$SCHEDULE' ($TIME_ZONE) would run trigger $NAME"
  exit 0
fi
echo "scheduled: '$SCHEDULE' ($TIME_ZONE) runs trigger $NAME; run it now with:"
echo "  gcloud scheduler jobs run $NAME --project=$PROJECT --location=$REGION"
