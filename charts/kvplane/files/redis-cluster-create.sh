# Forms a Redis Cluster of $NODES ("host:port ..."), each primary an equal share of the
# slots, once every node answers (redis-cli reads the password from REDISCLI_AUTH).
# A formed cluster is left alone; a node that lost its identity (a pod restarted without
# storage) is added back and given the slots nobody serves.
set -eu
addrs=""
for node in $NODES; do
  host=${node%:*}
  port=${node##*:}
  tries=0
  until redis-cli -h "$host" -p "$port" ping >/dev/null 2>&1; do
    tries=$((tries + 1))
    if [ "$tries" -ge 300 ]; then echo "$node never answered"; exit 1; fi
    sleep 1
  done
  ip=$(getent hosts "$host" | awk '{ print $1; exit }')  # CLUSTER MEET takes addresses
  addrs="$addrs ${ip:-$host}:$port"
done
info() { redis-cli -h "${1%:*}" -p "${1##*:}" cluster info | tr -d '\r' | sed -n "s/^$2://p"; }
# the Job ends once every node serves (cluster_state:ok), not when the slots are only
# assigned: gossip takes a moment to tell every node
settled() {
  for node in $addrs; do
    tries=0
    until [ "$(info "$node" cluster_state)" = ok ]; do
      tries=$((tries + 1))
      if [ "$tries" -ge 300 ]; then echo "$node never reached cluster_state ok"; exit 1; fi
      sleep 0.2
    done
  done
}
first=$(echo $addrs | cut -d' ' -f1)
if [ "$(info "$first" cluster_known_nodes)" -le 1 ]; then
  redis-cli --cluster create $addrs --cluster-replicas 0 --cluster-yes
  settled
  exit 0
fi
for node in $addrs; do
  if [ "$(info "$node" cluster_known_nodes)" -le 1 ]; then
    redis-cli --cluster add-node "$node" "$first"
  fi
done
redis-cli --cluster fix "$first" --cluster-yes
settled
echo "cluster formed"
